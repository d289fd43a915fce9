//! Routes and canaries.

use super::*;
use lorafleet_admin_types::*;

pub(crate) fn show_route(c: &Client, r: &Value) {
    if c.output == Output::Json {
        println!("{r}");
        return;
    }
    for col in [
        "tenant",
        "model",
        "etag",
        "base_model",
        "target",
        "updated_at",
        "created_by",
    ] {
        println!("{col:<12} {}", cell(&r[col]));
    }
    let weights = rows_of(
        &r["weights"],
        &["lora_int_id", "adapter", "version", "weight_bp"],
    );
    if !weights.is_empty() {
        println!();
        table(
            &["lora_int_id", "adapter", "version", "weight_bp"],
            &weights,
        );
    }
}

pub(crate) fn route_path(tenant: &str, model: &str) -> String {
    format!("/routes/{}/{}", segment(tenant), segment(model))
}

pub(crate) async fn routes(c: &Client, cmd: RouteCmd) -> Result<(), Failure> {
    match cmd {
        RouteCmd::List { tenant } => {
            let q: Vec<(&str, String)> = tenant.into_iter().map(|t| ("tenant", t)).collect();
            let list: RouteList = c.get_as("/routes", &q).await?;
            let body = as_json(&list);
            if c.output == Output::Json {
                println!("{body}");
            } else {
                let rows: Vec<Vec<String>> = body["routes"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|r| {
                                let split = r["weights"]
                                    .as_array()
                                    .map(|w| {
                                        w.iter()
                                            .map(|w| {
                                                format!(
                                                    "{}={}",
                                                    cell(&w["lora_int_id"]),
                                                    cell(&w["weight_bp"])
                                                )
                                            })
                                            .collect::<Vec<_>>()
                                            .join(",")
                                    })
                                    .unwrap_or_default();
                                vec![
                                    cell(&r["tenant"]),
                                    cell(&r["model"]),
                                    cell(&r["etag"]),
                                    cell(&r["base_model"]),
                                    cell(&r["target"]),
                                    if split.is_empty() { "-".into() } else { split },
                                ]
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                table(
                    &["tenant", "model", "etag", "base_model", "target", "weights"],
                    &rows,
                );
            }
        }
        RouteCmd::Get { tenant, model } => {
            let route: RouteView = c.get_as(&route_path(&tenant, &model), &[]).await?;
            show_route(c, &as_json(&route));
        }
        RouteCmd::Set {
            tenant,
            model,
            weights,
            base,
            base_model,
            etag,
        } => {
            let mut list = Vec::new();
            if !base {
                for (i, w) in weights.iter().enumerate() {
                    let parsed = w.split_once('=').and_then(|(id, bp)| {
                        Some((
                            id.trim().parse::<i64>().ok()?,
                            bp.trim().parse::<u32>().ok()?,
                        ))
                    });
                    let (id, bp) = parsed.ok_or_else(|| {
                        fail(
                            USAGE,
                            format!(
                                "--weights: item {} {w:?} is not LORA_INT_ID=BASIS_POINTS",
                                i + 1
                            ),
                        )
                    })?;
                    list.push(Weight {
                        lora_int_id: id,
                        weight_bp: bp,
                    });
                }
            }
            let spec = RouteSpec {
                base_model,
                weights: list,
            };
            let route: RouteView = c
                .call_as(
                    reqwest::Method::PUT,
                    &route_path(&tenant, &model),
                    Some(&spec),
                    etag.as_deref(),
                )
                .await?;
            show_route(c, &as_json(&route));
        }
        RouteCmd::Promote {
            tenant,
            model,
            lora_int_id,
            etag,
        } => {
            let route: RouteView = c
                .call_as(
                    reqwest::Method::POST,
                    &format!("{}/promote", route_path(&tenant, &model)),
                    Some(&PromoteSpec { lora_int_id }),
                    Some(&etag),
                )
                .await?;
            show_route(c, &as_json(&route));
        }
        RouteCmd::Rollback {
            tenant,
            model,
            etag,
        } => {
            let route: RouteView = c
                .call_as(
                    reqwest::Method::POST,
                    &format!("{}/rollback", route_path(&tenant, &model)),
                    None::<&Value>,
                    Some(&etag),
                )
                .await?;
            show_route(c, &as_json(&route));
        }
        RouteCmd::Rollout(cmd) => rollout(c, cmd).await?,
    }
    Ok(())
}
