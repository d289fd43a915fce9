//! Adapter versions: register from an artifact (checked with the worker's own rules), list, show and retire.

use super::*;

pub(super) const ADAPTER_SELECT: &str =
    "SELECT a.lora_int_id, a.name, a.version, b.name AS base_model, t.name AS tenant,
        a.rank, a.alpha, a.use_rslora, a.target_modules, a.artifact_uri, a.artifact_sha256,
        a.artifact_bytes, a.artifact_files, a.features, a.vocab_size,
        a.state::TEXT AS state, a.created_at, a.retired_at
     FROM adapters a JOIN base_models b ON b.id = a.base_model_id
     LEFT JOIN tenants t ON t.id = a.tenant_id";

/// Adapter versions, by name and base model.
#[derive(Debug, Default, Deserialize)]
pub struct ListAdapters {
    pub name: Option<String>,
    pub base_model: Option<String>,
}

impl Query for ListAdapters {
    type Output = AdapterList;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<AdapterList, AdminError> {
        let f = self;
        let adapters: Vec<AdapterRow> = sqlx::query_as(sql!(
            "{ADAPTER_SELECT}
         WHERE ($1::TEXT IS NULL OR a.name = $1) AND ($2::TEXT IS NULL OR b.name = $2)
         ORDER BY a.name, a.version"
        ))
        .bind(f.name)
        .bind(f.base_model)
        .fetch_all(&s.pool)
        .await
        .map_err(db_error)?;
        Ok(AdapterList { adapters })
    }
}

/// What registration learns from the artifact itself.
#[derive(Debug)]
pub(super) struct Inspected {
    pub(super) rank: usize,
    pub(super) alpha: f32,
    pub(super) use_rslora: bool,
    pub(super) targets: Vec<String>,
    /// `dora`, `lora_bias`, `embed_tokens`, `lm_head`, `modules_to_save`,
    /// `trainable_tokens` (see `AdapterConfig::features`).
    pub(super) features: Vec<String>,
    /// The rows of its saved embedding layers, if it saves one whole.
    pub(super) vocab_size: Option<i32>,
    pub(super) digest: String,
    /// The bytes and files of the copy hashed: a worker refuses to fetch
    /// an artifact that has grown past them.
    pub(super) bytes: u64,
    pub(super) files: u32,
}

/// Reads and checks an adapter artifact against a base model: its
/// `adapter_config.json` (every rule the worker applies), the declared base
/// model, rank and target modules against the architecture, the weight
/// file's tensor shapes against the declared ranks, and its digest.
///
/// The artifact is copied into a private directory as it is hashed, and
/// the copy is what is inspected: a file changed in the artifact root
/// between the hash and the checks cannot pass unseen.
pub(super) fn inspect_artifact(
    roots: &ArtifactRoots,
    uri: &str,
    expected: &Expected,
) -> Result<Inspected, AdminError> {
    let dir = private_dir();
    let digest = roots
        .copy_hashed(uri, &dir)
        .map_err(|e| artifact_refusal(uri, e))?;
    let inspected = inspect_dir(&dir, digest, expected);
    let _ = std::fs::remove_dir_all(&dir);
    inspected
}

/// A private directory for one registration's copy of an artifact.
fn private_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "lorafleet-registration-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4()
    ))
}

/// What an artifact is checked against at registration.
#[derive(Debug, Clone)]
pub(super) struct Expected {
    pub(super) adapter_name: String,
    /// The base model it is registered on, and that model's architecture.
    pub(super) base_model: String,
    pub(super) architecture: String,
    pub(super) max_lora_rank: usize,
}

/// An artifact the admin plane could not reach or read, by field.
fn artifact_refusal(uri: &str, e: ArtifactError) -> AdminError {
    match e {
        ArtifactError::OutsideRoots { .. } => AdminError::unprocessable(
            AdminCode::ArtifactOutsideRoot,
            "artifact_uri",
            format!("{uri:?} lies outside the artifact root"),
        ),
        ArtifactError::InvalidUri { reason, .. } => {
            AdminError::unprocessable(AdminCode::InvalidArtifactUri, "artifact_uri", reason)
        }
        ArtifactError::NotFound { .. } => AdminError::unprocessable(
            AdminCode::ArtifactNotFound,
            "artifact_uri",
            format!("{uri:?} is not under the artifact root"),
        ),
        e @ ArtifactError::TooLarge { .. } => {
            AdminError::unprocessable(AdminCode::ArtifactTooLarge, "artifact_uri", e.to_string())
        }
        other => AdminError::unprocessable(
            AdminCode::ArtifactUnreadable,
            "artifact_uri",
            other.to_string(),
        ),
    }
}

/// Fetches an artifact from its object store into a private directory
/// (hashed as it is written) and checks it as [`inspect_artifact`] does.
async fn inspect_object(
    stores: &lorafleet_store::ObjectStores,
    uri: &str,
    expected: Expected,
) -> Result<Inspected, AdminError> {
    let dir = private_dir();
    let refused = |e: ArtifactError| match e {
        ArtifactError::NotFound { .. } => AdminError::unprocessable(
            AdminCode::ArtifactNotFound,
            "artifact_uri",
            format!("{uri:?}: the store holds no object under it"),
        ),
        other => artifact_refusal(uri, other),
    };
    let digest = stores
        .fetch_verified(uri, None, &dir)
        .await
        .map_err(refused)?;
    let d = dir.clone();
    let inspected = tokio::task::spawn_blocking(move || inspect_dir(&d, digest, &expected))
        .await
        .map_err(AdminError::internal);
    let _ = tokio::fs::remove_dir_all(&dir).await;
    inspected?
}

/// [`inspect_artifact`] on a directory already resolved (or fetched) and
/// hashed to `digest`.
fn inspect_dir(
    dir: &std::path::Path,
    digest: String,
    expected: &Expected,
) -> Result<Inspected, AdminError> {
    let Expected {
        adapter_name,
        base_model,
        architecture,
        max_lora_rank,
    } = expected;
    let (base_model, max_lora_rank) = (base_model.as_str(), *max_lora_rank);
    let config_param = "adapter_config.json";
    let text = std::fs::read_to_string(dir.join("adapter_config.json")).map_err(|e| {
        AdminError::unprocessable(
            AdminCode::InvalidAdapterConfig,
            config_param,
            format!("cannot be read: {e}"),
        )
    })?;
    let architecture = Architecture::from_model_type(architecture).ok_or_else(|| {
        AdminError::unprocessable(
            AdminCode::InvalidField,
            "base_model",
            format!("has architecture {architecture:?}, which the engine does not serve"),
        )
    })?;
    // The worker's own rules, from the crate it uses: the config, its
    // targets against the architecture, the weight file's tensors.
    let config = AdapterConfig::from_text(adapter_name, &text, None)
        .and_then(|c| c.for_architecture(adapter_name, architecture))
        .map_err(adapter_refusal)?;
    // The declared base: PEFT records the name or path it was trained on;
    // its last path segment must name the base model it is registered to.
    let declared: Option<String> = serde_json::from_str::<Value>(&text).ok().and_then(|v| {
        v.get("base_model_name_or_path")?
            .as_str()
            .map(str::to_owned)
    });
    let base_param = "adapter_config.json.base_model_name_or_path";
    match declared {
        None => {
            return Err(AdminError::unprocessable(
                AdminCode::BaseModelMismatch,
                base_param,
                format!("is missing; the adapter must declare its base model {base_model:?}"),
            ));
        }
        Some(d) => {
            let last = |s: &str| {
                s.trim_end_matches('/')
                    .rsplit('/')
                    .next()
                    .unwrap_or("")
                    .to_owned()
            };
            if d != base_model && last(&d) != last(base_model) {
                return Err(AdminError::unprocessable(
                    AdminCode::BaseModelMismatch,
                    base_param,
                    format!(
                        "{d:?} does not name the base model {base_model:?} it is registered against"
                    ),
                ));
            }
        }
    }
    let rank = config.max_rank();
    if rank > max_lora_rank {
        let param = if config.r > max_lora_rank {
            "adapter_config.json.r"
        } else {
            "adapter_config.json.rank_pattern"
        };
        return Err(AdminError::unprocessable(
            AdminCode::RankTooLarge,
            param,
            format!("rank {rank} is above the fleet's max LoRA rank {max_lora_rank}"),
        ));
    }
    let weights = "adapter_model.safetensors";
    let header = safetensors_header::read(&dir.join(weights)).map_err(|e| {
        AdminError::unprocessable(AdminCode::InvalidAdapterWeights, weights, e.to_string())
    })?;
    tensors::check(adapter_name, &config, &header, None).map_err(adapter_refusal)?;
    let vocab_size = saved_vocab(adapter_name, dir, &header)?;
    let mut targets: Vec<String> = config
        .stored_targets()
        .iter()
        .map(|t| t.module_name().to_owned())
        .collect();
    for (on, name) in [
        (config.embed_tokens, "embed_tokens"),
        (config.lm_head, "lm_head"),
    ] {
        if on {
            targets.push(name.to_owned());
        }
    }
    let (bytes, files) = artifact_size(dir).map_err(|e| {
        AdminError::unprocessable(
            AdminCode::ArtifactUnreadable,
            "artifact_uri",
            format!("the copy cannot be measured: {e}"),
        )
    })?;
    Ok(Inspected {
        rank,
        alpha: config.lora_alpha,
        use_rslora: config.use_rslora,
        targets,
        features: config.features().into_iter().map(str::to_owned).collect(),
        vocab_size,
        digest,
        bytes,
        files,
    })
}

/// The vocabulary of an adapter's saved layers (their rows), if it saves
/// one whole; its own tokenizer, if it ships one, may not reach past them.
fn saved_vocab(
    adapter_name: &str,
    dir: &std::path::Path,
    header: &safetensors_header::Header,
) -> Result<Option<i32>, AdminError> {
    let Some(rows) = tensors::saved_vocab(adapter_name, header).map_err(adapter_refusal)? else {
        return Ok(None);
    };
    saved::check_tokenizer(adapter_name, dir, rows, "the saved lm_head or embed_tokens")
        .map_err(adapter_refusal)?;
    i32::try_from(rows).map(Some).map_err(|_| {
        AdminError::unprocessable(
            AdminCode::InvalidAdapterWeights,
            "adapter_model.safetensors",
            format!("the saved layers' {rows} rows are too many"),
        )
    })
}

/// The bytes and files under `dir` (a private copy: files and
/// directories only).
fn artifact_size(dir: &std::path::Path) -> std::io::Result<(u64, u32)> {
    let (mut bytes, mut files) = (0u64, 0u32);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                stack.push(entry.path());
            } else {
                bytes += entry.metadata()?.len();
                files += 1;
            }
        }
    }
    Ok((bytes, files))
}

/// An adapter refused by the artifact rules, as the admin API reports it:
/// a tensor's fault names the weight file, a config field's names that
/// field of `adapter_config.json`.
fn adapter_refusal(e: AdapterError) -> AdminError {
    const CONFIG: &str = "adapter_config.json";
    match &e {
        AdapterError::InvalidTensor { .. } => AdminError::unprocessable(
            AdminCode::InvalidAdapterWeights,
            "adapter_model.safetensors",
            e.to_string(),
        ),
        AdapterError::Invalid { field, .. } | AdapterError::Unsupported { field, .. } => {
            let param = if field.is_empty() || field == CONFIG {
                CONFIG.to_owned()
            } else if field.ends_with(".json") {
                // Another file of the artifact (its own tokenizer.json).
                field.clone()
            } else {
                format!("{CONFIG}.{field}")
            };
            AdminError::new(AdminCode::InvalidAdapterConfig, Some(&param), e.to_string())
        }
        AdapterError::RankTooLarge { .. }
        | AdapterError::BaseHashMismatch { .. }
        | AdapterError::Io { .. } => {
            AdminError::new(AdminCode::InvalidAdapterConfig, Some(CONFIG), e.to_string())
        }
    }
}

/// A new version's name and version, and its artifact URI as the registry
/// stores it (relative to the root, the same on every host), checked
/// before any file is read.
fn check_new_adapter(a: &NewAdapter) -> Result<String, AdminError> {
    let name_ok = !a.name.is_empty()
        && a.name.len() <= 128
        && a.name.as_bytes()[0].is_ascii_alphanumeric()
        && a.name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !name_ok {
        return Err(AdminError::field(
            "name",
            format!(
                "{:?} must be 1-128 characters of letters, digits and . _ -",
                a.name
            ),
        ));
    }
    if a.version == Some(0) {
        return Err(AdminError::field("version", "must be at least 1"));
    }
    if lorafleet_store::is_object_uri(&a.artifact_uri) {
        return Ok(a.artifact_uri.clone());
    }
    let uri = a
        .artifact_uri
        .strip_prefix("file:")
        .unwrap_or(&a.artifact_uri)
        .to_owned();
    if uri.starts_with('/') {
        return Err(AdminError::unprocessable(
            AdminCode::ArtifactOutsideRoot,
            "artifact_uri",
            "must be relative to the artifact root, as every worker resolves it under its own root",
        ));
    }
    Ok(uri)
}

/// An adapter version registered from its artifact, read and checked
/// with the worker's own rules before anything is written.
#[derive(Debug)]
pub struct RegisterAdapter(pub NewAdapter);

impl Command for RegisterAdapter {
    type Output = AdapterRow;

    async fn run(self, cx: &mut Cx<'_>) -> Result<AdapterRow, AdminError> {
        let a = self.0;
        let s = cx.state;
        let uri = check_new_adapter(&a)?;
        let object = lorafleet_store::is_object_uri(&uri);
        let roots = match (object, s.artifact_roots.clone()) {
            (false, None) => {
                return Err(AdminError::new(
                    AdminCode::NoArtifactRoot,
                    Some("artifact_uri"),
                    "this gateway has no --artifact-root, so it cannot read artifacts to register them"
                        .into(),
                ));
            }
            (_, roots) => roots,
        };
        let base: Option<(i64, String)> =
            sqlx::query_as("SELECT id, architecture FROM base_models WHERE name = $1")
                .bind(&a.base_model)
                .fetch_optional(&s.pool)
                .await
                .map_err(db_error)?;
        let (base_id, architecture) = base.ok_or_else(|| {
            AdminError::not_found("base_model", format!("base model {:?}", a.base_model))
        })?;
        let tenant = match &a.tenant {
            Some(t) => Some(tenant_id(&s.pool, t, "tenant").await?),
            None => None,
        };
        let expected = Expected {
            adapter_name: a.name.clone(),
            base_model: a.base_model.clone(),
            architecture,
            max_lora_rank: s.max_lora_rank,
        };
        let inspected = match roots {
            _ if object => inspect_object(&s.artifact_stores, &uri, expected).await?,
            Some(roots) => {
                // Hashing a large artifact is blocking work.
                let uri = a.artifact_uri.clone();
                tokio::task::spawn_blocking(move || inspect_artifact(&roots, &uri, &expected))
                    .await
                    .map_err(AdminError::internal)??
            }
            None => unreachable!("refused above without an artifact root"),
        };
        let tx = cx.db().await?;
        // Serialises version numbering per name.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('adapter:' || $1))")
            .bind(&a.name)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        let version: i32 = match a.version {
            Some(v) => {
                i32::try_from(v).map_err(|_| AdminError::field("version", "is too large"))?
            }
            None => sqlx::query_scalar(
                "SELECT COALESCE(max(version), 0) + 1 FROM adapters WHERE name = $1",
            )
            .bind(&a.name)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?,
        };
        let id: i64 = sqlx::query_scalar(
        "INSERT INTO adapters (name, version, base_model_id, tenant_id, rank, alpha, use_rslora,
                               target_modules, artifact_uri, artifact_sha256,
                               artifact_bytes, artifact_files, features, vocab_size)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
         RETURNING lora_int_id",
    )
    .bind(&a.name)
    .bind(version)
    .bind(base_id)
    .bind(tenant)
    .bind(inspected.rank as i32)
    .bind(f64::from(inspected.alpha))
    .bind(inspected.use_rslora)
    .bind(&inspected.targets)
    .bind(&uri)
    .bind(&inspected.digest)
    .bind(inspected.bytes as i64)
    .bind(inspected.files as i32)
    .bind(&inspected.features)
    .bind(inspected.vocab_size)
    .fetch_one(&mut *tx)
    .await
    .map_err(|e| match db_error(e) {
        e if e.code == AdminCode::Duplicate => AdminError::conflict(
            AdminCode::Duplicate,
            "version",
            format!("adapter {:?} version {version} already exists; versions are immutable, register a new one", a.name),
        ),
        e => e,
    })?;
        let row: AdapterRow = sqlx::query_as(sql!("{ADAPTER_SELECT} WHERE a.lora_int_id = $1"))
            .bind(id)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
        cx.record(
            "adapter.register",
            ("adapter", &id.to_string()),
            None,
            Some(to_json(&row)),
        );
        Ok(row)
    }
}

/// A `lora_int_id` path segment: a positive integer.
pub fn parse_lora_int_id(id: &str) -> Result<i64, AdminError> {
    id.parse().ok().filter(|v| *v > 0).ok_or_else(|| {
        AdminError::field("lora_int_id", format!("{id:?} is not a positive integer"))
    })
}

/// An adapter version retired: it takes no traffic again. Refused while a
/// route still sends it traffic.
#[derive(Debug)]
pub struct RetireAdapter {
    pub lora_int_id: i64,
}

impl Command for RetireAdapter {
    type Output = AdapterRow;

    async fn run(self, cx: &mut Cx<'_>) -> Result<AdapterRow, AdminError> {
        let id = self.lora_int_id;
        let tx = cx.db().await?;
        let before: Option<AdapterRow> = sqlx::query_as(sql!(
            "{ADAPTER_SELECT} WHERE a.lora_int_id = $1 FOR UPDATE OF a"
        ))
        .bind(id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error)?;
        let before =
            before.ok_or_else(|| AdminError::not_found("lora_int_id", format!("adapter {id}")))?;
        if before.state == "retired" {
            return Err(AdminError::conflict(
                AdminCode::NoChange,
                "lora_int_id",
                format!("adapter {id} is already retired"),
            ));
        }
        let routed: Vec<String> = sqlx::query_scalar(
            "SELECT t.name || '/' || r.model_name FROM routes r
         JOIN route_weights w ON w.route_id = r.id AND w.revision = r.current_revision
         JOIN tenants t ON t.id = r.tenant_id
         WHERE w.lora_int_id = $1 ORDER BY 1",
        )
        .bind(id)
        .fetch_all(&mut *tx)
        .await
        .map_err(db_error)?;
        if !routed.is_empty() {
            return Err(AdminError::conflict(
                AdminCode::AdapterInUse,
                "lora_int_id",
                format!(
                    "adapter {id} still takes traffic on route(s) {}; move them off it (promote or set) first",
                    routed.join(", ")
                ),
            ));
        }
        sqlx::query(
            "UPDATE adapters SET state = 'retired', retired_at = now() WHERE lora_int_id = $1",
        )
        .bind(id)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        let after: AdapterRow = sqlx::query_as(sql!("{ADAPTER_SELECT} WHERE a.lora_int_id = $1"))
            .bind(id)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
        cx.record(
            "adapter.retire",
            ("adapter", &id.to_string()),
            Some(to_json(&before)),
            Some(to_json(&after)),
        );
        Ok(after)
    }
}

/// Where admin artifacts come from: the configured roots, canonicalised.
pub fn artifact_roots(
    roots: &[PathBuf],
) -> Result<Option<Arc<ArtifactRoots>>, crate::flag_error::FlagError> {
    if roots.is_empty() {
        return Ok(None);
    }
    ArtifactRoots::new(roots)
        .map(|r| Some(Arc::new(r)))
        .map_err(|e| crate::flag_error::FlagError::new("--artifact-root", e.to_string()))
}
