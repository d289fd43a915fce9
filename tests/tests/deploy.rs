//! The Kubernetes manifests against the real binaries: each overlay is
//! rendered with kustomize (`kubectl kustomize`), and the rendered objects
//! are checked for what schema validation cannot see: probes point at ports
//! the processes really listen on, drains end before the kubelet kills, the
//! gateway resolves the workers' headless Service, and every flag and
//! environment setting is one the binaries accept (read from their
//! `--help`).

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::process::Command;

use lorafleet_tests::binary;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn render(overlay: &str) -> Vec<Value> {
    let dir = repo().join("deploy/k8s/overlays").join(overlay);
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&dir)
        .output()
        .expect("kubectl is required to render the kustomize overlays");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let v = <serde_yaml::Value as serde::Deserialize>::deserialize(doc).unwrap();
            serde_json::to_value(v).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// What a binary's subcommand accepts: its flags and their env fallbacks.
struct Accepts {
    flags: HashSet<String>,
    envs: HashSet<String>,
}

fn accepts(bin: &str, subcommand: &str) -> Accepts {
    let out = Command::new(binary(bin))
        .args([subcommand, "--help"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{bin} {subcommand} --help");
    let help = String::from_utf8(out.stdout).unwrap();
    let flags = help
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| w.trim_end_matches(',').to_owned())
        .collect();
    let envs = help
        .split("[env: ")
        .skip(1)
        .filter_map(|s| s.split(['=', ']']).next())
        .map(str::to_owned)
        .collect();
    Accepts { flags, envs }
}

/// Settings read by the telemetry setup rather than by clap.
const TELEMETRY_ENVS: &[&str] = &[
    "LORAFLEET_LOG_FORMAT",
    "RUST_LOG",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
];

/// Every environment variable a container gets: its own `env`, and the
/// data of the ConfigMaps it loads with `envFrom`.
fn container_env(objects: &[Value], container: &Value) -> BTreeMap<String, Option<String>> {
    let mut env = BTreeMap::new();
    for from in container["envFrom"].as_array().into_iter().flatten() {
        let name = from["configMapRef"]["name"].as_str().expect("configMapRef");
        let cm = find(objects, "ConfigMap", name);
        for (k, v) in cm["data"].as_object().unwrap() {
            env.insert(k.clone(), v.as_str().map(str::to_owned));
        }
    }
    for e in container["env"].as_array().into_iter().flatten() {
        env.insert(
            e["name"].as_str().unwrap().to_owned(),
            e["value"].as_str().map(str::to_owned),
        );
    }
    env
}

fn port_of(listen: &str) -> u64 {
    listen.rsplit(':').next().unwrap().parse().unwrap()
}

/// The pod template and its one container of a workload.
fn pod_of<'a>(objects: &'a [Value], kind: &str, name: &str) -> (&'a Value, &'a Value) {
    let w = find(objects, kind, name);
    let pod = &w["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1, "{kind} {name} has one container");
    (pod, &containers[0])
}

fn container_port(container: &Value, port: &Value) -> u64 {
    let ports = container["ports"].as_array().unwrap();
    let found = match port {
        Value::String(name) => ports.iter().find(|p| p["name"] == name.as_str()),
        Value::Number(n) => ports
            .iter()
            .find(|p| p["containerPort"].as_u64() == n.as_u64()),
        other => panic!("port {other}"),
    };
    found.unwrap_or_else(|| {
        panic!(
            "port {port} is not a containerPort of {}",
            container["name"]
        )
    })["containerPort"]
        .as_u64()
        .unwrap()
}

/// Checks one server container: its flags and env are accepted, each named
/// port is where the process listens, each probe hits a real port and
/// endpoint, and the drain ends before the grace period.
fn check_server(
    objects: &[Value],
    kind: &str,
    name: &str,
    bin: &str,
    listens: &[(&str, &str)],
) -> BTreeMap<String, Option<String>> {
    let (pod, c) = pod_of(objects, kind, name);
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let accepted = accepts(bin, args[0]);
    for a in &args[1..] {
        if let Some(flag) = a.strip_prefix("--") {
            let flag = format!("--{}", flag.split('=').next().unwrap());
            assert!(
                accepted.flags.contains(&flag),
                "{bin} does not accept {flag}"
            );
        }
    }
    let env = container_env(objects, c);
    for k in env.keys() {
        assert!(
            accepted.envs.contains(k) || TELEMETRY_ENVS.contains(&k.as_str()),
            "{kind} {name}: {bin} {} reads no setting {k}",
            args[0]
        );
    }
    // Named ports are where the process listens.
    for (port_name, listen_env) in listens {
        let listen = env[*listen_env]
            .as_deref()
            .expect("a literal listen address");
        assert_eq!(
            container_port(c, &Value::String((*port_name).into())),
            port_of(listen),
            "{kind} {name}: port {port_name} vs {listen_env}={listen}"
        );
    }
    // Probes hit real ports, and real endpoints.
    let mut probes = 0;
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let p = &c[probe];
        if p.is_null() {
            continue;
        }
        probes += 1;
        if let Some(http) = p.get("httpGet") {
            container_port(c, &http["port"]);
            let path = http["path"].as_str().unwrap();
            assert!(
                ["/healthz", "/readyz"].contains(&path),
                "{kind} {name}: {probe} path {path} is not an endpoint the gateway serves"
            );
        } else if let Some(grpc) = p.get("grpc") {
            // grpc.health.v1 on the worker's plain-text health port: the
            // kubelet cannot present a client certificate to the mTLS one.
            let port = container_port(c, &grpc["port"]);
            assert_eq!(port, container_port(c, &Value::String("health".into())));
        } else {
            panic!("{kind} {name}: {probe} is neither httpGet nor grpc");
        }
    }
    assert!(probes >= 2, "{kind} {name}: readiness and liveness probes");
    // The drain ends before the kubelet's SIGKILL.
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    let pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .unwrap_or(0);
    let drain: u64 = env["LORAFLEET_DRAIN_DEADLINE_SECS"]
        .as_deref()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        pause + drain < grace,
        "{kind} {name}: preStop {pause} s + drain {drain} s must end before the {grace} s grace period"
    );
    // The gateway also ends cut requests (5 s) and flushes its audit queue
    // before the kubelet's SIGKILL.
    if let Some(flush) = env.get("LORAFLEET_AUDIT_FLUSH_SECS") {
        let flush: u64 = flush.as_deref().unwrap().parse().unwrap();
        assert!(
            pause + drain + 5 + flush < grace,
            "{kind} {name}: preStop {pause} s + drain {drain} s + 5 s + audit flush {flush} s \
             must end before the {grace} s grace period"
        );
    }
    // Prometheus scrapes the metrics port.
    let annotations = &find(objects, kind, name)["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(
        annotations["prometheus.io/port"].as_str().unwrap(),
        container_port(c, &Value::String("metrics".into())).to_string()
    );
    env
}

/// The Secret volume a file path lies in (mounted without subPath, so that
/// rotated Secrets reach the file).
fn secret_of(pod: &Value, container: &Value, path: &str) -> String {
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| path.starts_with(&format!("{}/", m["mountPath"].as_str().unwrap())))
        .unwrap_or_else(|| panic!("{path} is on no volume mount"));
    assert!(
        mount.get("subPath").is_none(),
        "{path}: a subPath mount never sees a rotated Secret"
    );
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    volume["secret"]["secretName"]
        .as_str()
        .unwrap_or_else(|| panic!("{path} is not from a Secret"))
        .to_owned()
}

/// Workers require mutual TLS, gateways present it, both read their files
/// from the Secrets that deploy/k8s/cert-manager issues, with the usages
/// and names each side checks.
fn check_mutual_tls(objects: &[Value], gateway_env: &BTreeMap<String, Option<String>>) {
    let (wpod, worker) = pod_of(objects, "StatefulSet", "lorafleet-worker");
    let (gpod, gateway) = pod_of(objects, "Deployment", "lorafleet-gateway");
    let wenv = container_env(objects, worker);
    assert!(!wenv.contains_key("LORAFLEET_INSECURE_PLAINTEXT"));
    assert!(!gateway_env.contains_key("LORAFLEET_INSECURE_PLAINTEXT"));
    let secret = |pod, c, env: &BTreeMap<String, Option<String>>, keys: [&str; 3]| {
        let names: Vec<String> = keys
            .iter()
            .map(|k| {
                let path = env[*k].as_deref().unwrap_or_else(|| panic!("{k}"));
                secret_of(pod, c, path)
            })
            .collect();
        assert!(names.iter().all(|n| n == &names[0]), "{names:?}");
        names[0].clone()
    };
    let worker_secret = secret(
        wpod,
        worker,
        &wenv,
        [
            "LORAFLEET_TLS_CERT",
            "LORAFLEET_TLS_KEY",
            "LORAFLEET_TLS_CLIENT_CA",
        ],
    );
    let gateway_secret = secret(
        gpod,
        gateway,
        gateway_env,
        [
            "LORAFLEET_WORKER_TLS_CERT",
            "LORAFLEET_WORKER_TLS_KEY",
            "LORAFLEET_WORKER_TLS_CA",
        ],
    );
    // The name the gateway checks: --worker-tls-name, else the DNS host.
    let checked = match gateway_env.get("LORAFLEET_WORKER_TLS_NAME") {
        Some(name) => name.clone().unwrap(),
        None => {
            let dns = gateway_env["LORAFLEET_WORKERS_DNS"].as_deref().unwrap();
            dns.rsplit_once(':').unwrap().0.to_owned()
        }
    };
    let text =
        std::fs::read_to_string(repo().join("deploy/k8s/cert-manager/certificates.yaml")).unwrap();
    let issued: Vec<Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let v = <serde_yaml::Value as serde::Deserialize>::deserialize(doc).unwrap();
            serde_json::to_value(v).unwrap()
        })
        .filter(|v| v["kind"] == "Certificate")
        .collect();
    let cert_for = |secret: &str| {
        issued
            .iter()
            .find(|c| c["spec"]["secretName"] == secret)
            .unwrap_or_else(|| panic!("deploy/k8s/cert-manager issues no Secret {secret}"))
    };
    let namespace = find(objects, "StatefulSet", "lorafleet-worker")["metadata"]["namespace"]
        .as_str()
        .unwrap();
    let w = cert_for(&worker_secret);
    let g = cert_for(&gateway_secret);
    for c in [w, g] {
        assert_eq!(c["metadata"]["namespace"], namespace);
        // Both issued by the one fleet CA.
        assert_eq!(c["spec"]["issuerRef"], w["spec"]["issuerRef"]);
    }
    let usages = |c: &Value| -> Vec<String> {
        c["spec"]["usages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u.as_str().unwrap().to_owned())
            .collect()
    };
    assert!(usages(w).contains(&"server auth".into()));
    assert!(!usages(w).contains(&"client auth".into()));
    assert!(usages(g).contains(&"client auth".into()));
    assert!(!usages(g).contains(&"server auth".into()));
    let names: Vec<&str> = w["spec"]["dnsNames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert!(
        names.contains(&checked.as_str()),
        "the workers' certificate must carry {checked}, the name gateways check: {names:?}"
    );
    // And each pod's own name, for gateways that list pods.
    let service = find(objects, "StatefulSet", "lorafleet-worker")["spec"]["serviceName"]
        .as_str()
        .unwrap();
    let pod_wildcard = format!("*.{service}.{namespace}.svc.cluster.local");
    assert!(names.contains(&pod_wildcard.as_str()), "{names:?}");
}

fn check_overlay(overlay: &str) -> Vec<Value> {
    let objects = render(overlay);
    let gateway_env = check_server(
        &objects,
        "Deployment",
        "lorafleet-gateway",
        "lorafleet-gateway",
        &[
            ("http", "LORAFLEET_LISTEN"),
            ("metrics", "LORAFLEET_METRICS_LISTEN"),
        ],
    );
    // The admin plane is its own Deployment, serving the admin API alone.
    let admin_env = check_server(
        &objects,
        "Deployment",
        "lorafleet-gateway-admin",
        "lorafleet-gateway",
        &[
            ("admin", "LORAFLEET_ADMIN_LISTEN"),
            ("metrics", "LORAFLEET_METRICS_LISTEN"),
        ],
    );
    assert_eq!(
        admin_env["LORAFLEET_ADMIN_ONLY"].as_deref(),
        Some("true"),
        "the admin plane serves no public listener"
    );
    check_mutual_tls(&objects, &admin_env);
    // Least privilege: only the admin plane's pods hold the admin login,
    // from a Secret of its own that the public pods do not mount.
    let secret_refs = |name: &str| -> BTreeMap<String, String> {
        let (_, c) = pod_of(&objects, "Deployment", name);
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| {
                let secret = e["valueFrom"]["secretKeyRef"]["name"].as_str()?;
                Some((e["name"].as_str()?.to_owned(), secret.to_owned()))
            })
            .collect()
    };
    let (public_secrets, admin_secrets) = (
        secret_refs("lorafleet-gateway"),
        secret_refs("lorafleet-gateway-admin"),
    );
    assert!(
        !gateway_env
            .keys()
            .any(|k| k.starts_with("LORAFLEET_ADMIN_")),
        "the public gateway has admin settings: {gateway_env:?}"
    );
    let admin_secret = &admin_secrets["LORAFLEET_ADMIN_DATABASE_URL"];
    assert!(
        public_secrets.values().all(|s| s != admin_secret),
        "the public gateway mounts {admin_secret}: {public_secrets:?}"
    );
    check_server(
        &objects,
        "StatefulSet",
        "lorafleet-worker",
        "lorafleet-worker",
        &[
            ("grpc", "LORAFLEET_GRPC_LISTEN"),
            ("metrics", "LORAFLEET_METRICS_LISTEN"),
            ("health", "LORAFLEET_HEALTH_LISTEN"),
        ],
    );
    check_mutual_tls(&objects, &gateway_env);

    // Without Redis, each gateway replica enforces limit / replicas: the
    // most the autoscaler may run, or the fleet admits more than a limit.
    let hpa = find(&objects, "HorizontalPodAutoscaler", "lorafleet-gateway");
    assert_eq!(
        gateway_env["LORAFLEET_GATEWAY_REPLICAS"]
            .as_deref()
            .and_then(|r| r.parse::<u64>().ok()),
        hpa["spec"]["maxReplicas"].as_u64(),
        "LORAFLEET_GATEWAY_REPLICAS is the HPA's maxReplicas"
    );

    // The gateway resolves the workers' headless Service.
    let sts = find(&objects, "StatefulSet", "lorafleet-worker");
    let service_name = sts["spec"]["serviceName"].as_str().unwrap();
    let svc = find(&objects, "Service", service_name);
    assert_eq!(
        svc["spec"]["clusterIP"], "None",
        "the worker Service is headless"
    );
    assert_eq!(
        svc["spec"]["selector"],
        sts["spec"]["template"]["metadata"]["labels"]
    );
    let dns = gateway_env["LORAFLEET_WORKERS_DNS"].as_deref().unwrap();
    let (host, port) = dns.rsplit_once(':').unwrap();
    let mut labels = host.split('.');
    assert_eq!(labels.next(), Some(service_name), "{dns}");
    let namespace = sts["metadata"]["namespace"].as_str().unwrap();
    if let Some(ns) = labels.next() {
        assert_eq!(ns, namespace, "{dns}");
    }
    let (_, worker) = pod_of(&objects, "StatefulSet", "lorafleet-worker");
    assert_eq!(
        port.parse::<u64>().unwrap(),
        container_port(worker, &Value::String("grpc".into()))
    );
    // Worker ids are the StatefulSet's stable pod names.
    let id = worker["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "LORAFLEET_WORKER_ID")
        .expect("LORAFLEET_WORKER_ID");
    assert_eq!(id["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");

    // Services target named container ports that exist.
    for svc in objects.iter().filter(|o| o["kind"] == "Service") {
        let selector = svc["spec"]["selector"]["app.kubernetes.io/name"]
            .as_str()
            .unwrap();
        let (_, c) = match selector {
            "lorafleet-worker" => pod_of(&objects, "StatefulSet", selector),
            _ => pod_of(&objects, "Deployment", selector),
        };
        for p in svc["spec"]["ports"].as_array().unwrap() {
            container_port(c, &p["targetPort"]);
        }
    }
    // The admin API has its own Service, and the public one does not carry it.
    let public = find(&objects, "Service", "lorafleet-gateway");
    let admin = find(&objects, "Service", "lorafleet-gateway-admin");
    assert!(
        public["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["targetPort"] != "admin")
    );
    assert_eq!(admin["spec"]["ports"][0]["targetPort"], "admin");
    assert_eq!(
        admin["spec"]["selector"]["app.kubernetes.io/name"],
        "lorafleet-gateway-admin"
    );

    // NetworkPolicies name real ports; workers admit gRPC only from gateways.
    let np = find(&objects, "NetworkPolicy", "lorafleet-worker");
    let grpc_rule = np["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["ports"][0]["port"] == "grpc")
        .unwrap();
    let from: Vec<&Value> = grpc_rule["from"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| &f["podSelector"]["matchLabels"]["app.kubernetes.io/name"])
        .collect();
    assert_eq!(from, ["lorafleet-gateway", "lorafleet-gateway-admin"]);
    let np = find(&objects, "NetworkPolicy", "lorafleet-gateway");
    assert!(
        np["spec"]["ingress"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["ports"][0]["port"] != "admin"),
        "the public gateways' policy admits no admin port"
    );
    let np = find(&objects, "NetworkPolicy", "lorafleet-gateway-admin");
    let admin_rule = np["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["ports"][0]["port"] == "admin")
        .unwrap();
    assert!(admin_rule["from"].as_array().is_some_and(|f| !f.is_empty()));

    // The audit spool outlives any pod: a volume every gateway pod shares
    // (ReadWriteMany), so that a live pod adopts a gone pod's rows.
    let (gw_pod, gw) = pod_of(&objects, "Deployment", "lorafleet-gateway");
    let spool_volume = gw_pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "spool")
        .unwrap();
    let claim = spool_volume["persistentVolumeClaim"]["claimName"]
        .as_str()
        .expect("the audit spool is a PersistentVolumeClaim, not an emptyDir");
    let pvc = find(&objects, "PersistentVolumeClaim", claim);
    assert_eq!(pvc["spec"]["accessModes"][0], "ReadWriteMany");
    let spool_mount = gw["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "spool")
        .unwrap()["mountPath"]
        .as_str()
        .unwrap();
    let spool_dir = gateway_env["LORAFLEET_AUDIT_SPOOL"].as_deref().unwrap();
    assert!(
        spool_dir.starts_with(&format!("{spool_mount}/")),
        "{spool_dir}"
    );
    let owner = gw["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "LORAFLEET_AUDIT_SPOOL_OWNER")
        .expect("each pod names its own spool directory");
    assert_eq!(owner["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");

    // The migration Job runs the real subcommand with the real settings.
    let (_, job) = pod_of(&objects, "Job", "lorafleet-migrate");
    // The schema owner's credential is not the serving processes'.
    let secret_of = |c: &Value| {
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "DATABASE_URL")
            .unwrap()["valueFrom"]["secretKeyRef"]["name"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_ne!(
        secret_of(job),
        secret_of(gw),
        "two Secrets: owner and runtime"
    );
    assert_eq!(job["args"][0], "migrate");
    let accepted = accepts("lorafleet-gateway", "migrate");
    for e in job["env"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap();
        assert!(
            accepted.envs.contains(name) || TELEMETRY_ENVS.contains(&name),
            "migrate reads no setting {name}"
        );
    }

    // Key files each gateway is told to read are in its mounted key Secret,
    // where the overlay provides that Secret.
    for (name, env) in [
        ("lorafleet-gateway", &gateway_env),
        ("lorafleet-gateway-admin", &admin_env),
    ] {
        let (gw_pod, gw) = pod_of(&objects, "Deployment", name);
        let keys_volume = gw_pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "keys")
            .unwrap();
        let keys_secret = keys_volume["secret"]["secretName"].as_str().unwrap();
        let mount = gw["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == "keys")
            .unwrap()["mountPath"]
            .as_str()
            .unwrap();
        if let Some(secret) = objects
            .iter()
            .find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == keys_secret)
        {
            for (k, v) in env {
                if k.ends_with("_FILE")
                    && let Some(path) = v
                {
                    let file = path.strip_prefix(&format!("{mount}/")).unwrap_or_else(|| {
                        panic!("{name}: {k}={path} is not under the keys mount {mount}")
                    });
                    assert!(
                        secret["data"].get(file).is_some(),
                        "{name}: {k}={path}: the Secret {keys_secret} has no {file}"
                    );
                }
            }
        }
    }
    objects
}

#[test]
fn the_dev_cpu_overlay_renders_and_matches_the_binaries() {
    let objects = check_overlay("dev-cpu");
    let (_, worker) = pod_of(&objects, "StatefulSet", "lorafleet-worker");
    assert!(worker["image"].as_str().unwrap().ends_with("-cpu"));
    assert!(
        worker["resources"]["limits"]
            .get("nvidia.com/gpu")
            .is_none()
    );
    // Every Secret the pods reference exists in the rendered dev fleet.
    let (_, gateway) = pod_of(&objects, "Deployment", "lorafleet-gateway");
    let (_, admin) = pod_of(&objects, "Deployment", "lorafleet-gateway-admin");
    let (_, job) = pod_of(&objects, "Job", "lorafleet-migrate");
    for e in gateway["env"]
        .as_array()
        .unwrap()
        .iter()
        .chain(admin["env"].as_array().unwrap())
        .chain(job["env"].as_array().unwrap())
    {
        if let Some(name) = e["valueFrom"]["secretKeyRef"]["name"].as_str() {
            let key = e["valueFrom"]["secretKeyRef"]["key"].as_str().unwrap();
            let secret = find(&objects, "Secret", name);
            assert!(secret["data"].get(key).is_some(), "{name} has no {key}");
        }
    }
}

#[test]
fn the_gpu_overlay_renders_and_matches_the_binaries() {
    let objects = check_overlay("gpu");
    let (pod, worker) = pod_of(&objects, "StatefulSet", "lorafleet-worker");
    assert!(worker["image"].as_str().unwrap().ends_with("-cuda"));
    assert_eq!(worker["resources"]["limits"]["nvidia.com/gpu"], "1");
    assert!(pod["tolerations"][0]["key"] == "nvidia.com/gpu");
    let env = container_env(&objects, worker);
    assert_eq!(env["LORAFLEET_BACKEND"].as_deref(), Some("cuda"));
    assert_eq!(env["LORAFLEET_MAX_LORAS"].as_deref(), Some("32"));
}
