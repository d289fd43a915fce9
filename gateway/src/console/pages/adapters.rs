//! Adapters: every version with its digest, base model, rank, targets and
//! state; register a new version from an artifact URI; retire one.

use super::*;
use crate::admin::types::NewAdapter;
use crate::admin::{
    ListAdapters, ListBaseModels, RegisterAdapter, RetireAdapter, parse_lora_int_id,
};

pub(super) async fn page(State(c): State<Console>, s: Session) -> Response {
    render(&c, &s, Outcome::default()).await
}

async fn render(c: &Console, s: &Session, outcome: Outcome) -> Response {
    let data = async {
        let adapters = c.read(s, ListAdapters::default()).await?;
        let bases = c.read(s, ListBaseModels).await?;
        let rows: Vec<Value> = adapters
            .adapters
            .iter()
            .map(|a| {
                json!({
                    "lora_int_id": a.lora_int_id,
                    "name": a.name,
                    "version": a.version,
                    "tenant": a.tenant,
                    "base_model": a.base_model,
                    "rank": a.rank,
                    "alpha": a.alpha,
                    "use_rslora": a.use_rslora,
                    "targets": a.target_modules.join(", "),
                    "features": a.features.join(", "),
                    "artifact_uri": a.artifact_uri,
                    "sha256": a.artifact_sha256,
                    "sha256_short": short(&a.artifact_sha256),
                    "state": a.state,
                    "created_at": a.created_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                })
            })
            .collect();
        let bases: Vec<&str> = bases.base_models.iter().map(|b| b.name.as_str()).collect();
        Ok(json!({ "adapters": rows, "base_models": bases }))
    }
    .await;
    show(c, s, "adapters.html", "adapters", outcome, data)
}

pub(super) async fn register(
    State(c): State<Console>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = async {
        let spec = NewAdapter {
            name: fields.get("name").to_owned(),
            version: number(&fields, "version")?,
            base_model: fields.get("base_model").to_owned(),
            tenant: non_blank(fields.get("tenant")).map(str::to_owned),
            artifact_uri: fields.get("artifact_uri").to_owned(),
        };
        c.exec(&s, RegisterAdapter(spec)).await
    }
    .await;
    match result {
        Ok(a) => {
            let notice = format!(
                "registered {}:v{} as adapter {}",
                a.name, a.version, a.lora_int_id
            );
            let outcome = Outcome {
                form: Some("register"),
                notice: Some(notice),
                ..Outcome::default()
            };
            render(&c, &s, outcome).await
        }
        Err(e) => render(&c, &s, Outcome::refused("register", e, Some(&fields))).await,
    }
}

pub(super) async fn retire(
    State(c): State<Console>,
    Path(id): Path<String>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = match parse_lora_int_id(&id) {
        Ok(lora_int_id) => c.exec(&s, RetireAdapter { lora_int_id }).await,
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(_) => Redirect::to("/console/adapters").into_response(),
        Err(e) => render(&c, &s, Outcome::refused("retire", e, Some(&fields))).await,
    }
}
