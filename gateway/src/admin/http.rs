//! The admin API over HTTP: each handler reads its caller from the bearer
//! token, its command or query from the path, `If-Match` and the body, runs
//! it through [`AdminState::exec`] / [`AdminState::read`], and writes the
//! answer. No rule of the admin plane lives here.

use axum::extract::Query as Params;
use axum::extract::rejection::QueryRejection;

use super::*;
use axum::routing::patch;

use crate::rollout::Action;

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/admin/v1/tenants", get(list_tenants).post(create_tenant))
        .route("/admin/v1/tenants/{tenant}", patch(update_tenant))
        .route("/admin/v1/tenants/{tenant}/disable", post(disable_tenant))
        .route("/admin/v1/tenants/{tenant}/enable", post(enable_tenant))
        .route(
            "/admin/v1/tenants/{tenant}/keys",
            get(list_keys).post(create_key),
        )
        .route("/admin/v1/keys/{prefix}/revoke", post(revoke_key))
        .route(
            "/admin/v1/base-models",
            get(list_base_models).post(register_base_model),
        )
        .route(
            "/admin/v1/adapters",
            get(list_adapters).post(register_adapter),
        )
        .route(
            "/admin/v1/adapters/{lora_int_id}/retire",
            post(retire_adapter),
        )
        .route("/admin/v1/routes", get(list_routes))
        .route(
            "/admin/v1/routes/{tenant}/{model}",
            get(get_route).put(put_route),
        )
        .route("/admin/v1/routes/{tenant}/{model}/promote", post(promote))
        .route("/admin/v1/routes/{tenant}/{model}/rollback", post(rollback))
        .route(
            "/admin/v1/routes/{tenant}/{model}/rollout",
            get(get_rollout).post(start_rollout),
        )
        .route(
            "/admin/v1/routes/{tenant}/{model}/rollout/{action}",
            post(change_rollout),
        )
        .route(
            "/admin/v1/routes/{tenant}/{model}/evals",
            get(list_eval_sets).post(register_eval_set),
        )
        .route("/admin/v1/tokens/revoke", post(revoke_token))
        .route("/admin/v1/tokens/revoke-own", post(revoke_own_token))
        .route("/admin/v1/tenant-tokens/revoke", post(revoke_tenant_token))
        .route("/admin/v1/fleet", get(fleet_view))
        .route("/admin/v1/audit", get(audit_query))
        .route(
            "/admin/v1/audit/partitions",
            get(read_query::<ListAuditPartitions>),
        )
        .route("/admin/v1/changes", get(read_query::<ListChanges>))
        .route("/admin/v1/usage", get(read_query::<UsageReport>))
        .route(
            "/admin/v1/prices",
            get(read_query::<ListPrices>).post(set_price),
        )
        .route("/healthz", get(|| async { "ok" }))
        .fallback(|| async {
            AdminError::new(AdminCode::NotFound, None, "no such admin endpoint".into())
        })
        .with_state(state)
}

type Answer = Result<Response, AdminError>;

/// The caller a request's bearer token names.
fn caller(s: &AdminState, headers: &HeaderMap) -> Result<Caller, AdminError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let token = auth::bearer(value)
        .map_err(|e| AdminError::new(AdminCode::InvalidAdminToken, None, e.to_string()))?;
    Ok(Caller::new(&s.verify(token)?))
}

/// A JSON answer carrying the request id.
/// The body is serialized straight to bytes (a report of thousands of rows
/// is not built as a JSON tree first).
fn reply<T: Serialize>(status: StatusCode, caller: &Caller, body: &T) -> Response {
    let mut r = (status, axum::Json(body)).into_response();
    request_id(&mut r, caller);
    r
}

fn request_id(r: &mut Response, caller: &Caller) {
    if let Ok(v) = HeaderValue::from_str(&caller.request_id().to_string()) {
        r.headers_mut().insert("x-request-id", v);
    }
}

/// A route's answer, with its etag.
fn route_reply(status: StatusCode, caller: &Caller, view: &RouteView) -> Response {
    let mut r = reply(status, caller, view);
    if let Ok(v) = HeaderValue::from_str(&view.etag) {
        r.headers_mut().insert(header::ETAG, v);
    }
    r
}

/// The revision the client last saw, from `If-Match`.
fn if_match(headers: &HeaderMap) -> Result<Option<i32>, AdminError> {
    let value = headers
        .get(header::IF_MATCH)
        .map(|v| v.to_str().unwrap_or_default());
    parse_etag(value)
}

/// A query string's filters, or a refusal naming the query.
fn filters<T>(q: Result<Params<T>, QueryRejection>) -> Result<T, AdminError> {
    q.map(|Params(f)| f)
        .map_err(|e| AdminError::field("query", e.body_text()))
}

async fn list_tenants(State(s): State<AdminState>, headers: HeaderMap) -> Answer {
    let c = caller(&s, &headers)?;
    let list = s.read(&c, ListTenants).await?;
    Ok(reply(StatusCode::OK, &c, &list))
}

async fn create_tenant(State(s): State<AdminState>, headers: HeaderMap, body: Bytes) -> Answer {
    let c = caller(&s, &headers)?;
    let row = s.exec(&c, CreateTenant(parse_body(&body)?)).await?;
    Ok(reply(StatusCode::CREATED, &c, &row))
}

async fn update_tenant(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Answer {
    let c = caller(&s, &headers)?;
    let patch = parse_body(&body)?;
    let row = s.exec(&c, UpdateTenant { tenant, patch }).await?;
    Ok(reply(StatusCode::OK, &c, &row))
}

async fn switch_tenant(
    s: AdminState,
    headers: HeaderMap,
    tenant: String,
    disabled: bool,
) -> Answer {
    let c = caller(&s, &headers)?;
    let row = s.exec(&c, SetTenantDisabled { tenant, disabled }).await?;
    Ok(reply(StatusCode::OK, &c, &row))
}

async fn disable_tenant(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Answer {
    switch_tenant(s, headers, tenant, true).await
}

async fn enable_tenant(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Answer {
    switch_tenant(s, headers, tenant, false).await
}

async fn list_keys(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let list = s.read(&c, ListKeys { tenant }).await?;
    Ok(reply(StatusCode::OK, &c, &list))
}

async fn create_key(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Answer {
    let c = caller(&s, &headers)?;
    let spec = parse_body(&body)?;
    let created = s.exec(&c, CreateKey { tenant, spec }).await?;
    Ok(reply(StatusCode::CREATED, &c, &created))
}

async fn revoke_key(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(prefix): Path<String>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let row = s.exec(&c, RevokeKey { prefix }).await?;
    Ok(reply(StatusCode::OK, &c, &row))
}

async fn list_base_models(State(s): State<AdminState>, headers: HeaderMap) -> Answer {
    let c = caller(&s, &headers)?;
    let list = s.read(&c, ListBaseModels).await?;
    Ok(reply(StatusCode::OK, &c, &list))
}

async fn register_base_model(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Answer {
    let c = caller(&s, &headers)?;
    let row = s.exec(&c, RegisterBaseModel(parse_body(&body)?)).await?;
    Ok(reply(StatusCode::CREATED, &c, &row))
}

async fn set_price(State(s): State<AdminState>, headers: HeaderMap, body: Bytes) -> Answer {
    let c = caller(&s, &headers)?;
    let row = s.exec(&c, SetPrice(parse_body(&body)?)).await?;
    Ok(reply(StatusCode::CREATED, &c, &row))
}

async fn list_adapters(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Params(q): Params<ListAdapters>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let list = s.read(&c, q).await?;
    Ok(reply(StatusCode::OK, &c, &list))
}

async fn register_adapter(State(s): State<AdminState>, headers: HeaderMap, body: Bytes) -> Answer {
    let c = caller(&s, &headers)?;
    let row = s.exec(&c, RegisterAdapter(parse_body(&body)?)).await?;
    Ok(reply(StatusCode::CREATED, &c, &row))
}

async fn retire_adapter(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let lora_int_id = parse_lora_int_id(&id)?;
    let row = s.exec(&c, RetireAdapter { lora_int_id }).await?;
    Ok(reply(StatusCode::OK, &c, &row))
}

async fn list_routes(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Params(q): Params<ListRoutes>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let list = s.read(&c, q).await?;
    Ok(reply(StatusCode::OK, &c, &list))
}

async fn get_route(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let view = s.read(&c, GetRoute { tenant, model }).await?;
    Ok(route_reply(StatusCode::OK, &c, &view))
}

async fn put_route(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let c = caller(&s, &headers)?;
    let command = PutRoute {
        tenant,
        model,
        if_match: if_match(&headers)?,
        spec: parse_body(&body)?,
    };
    let written = s.exec(&c, command).await?;
    let status = if written.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(route_reply(status, &c, &written.route))
}

async fn promote(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let c = caller(&s, &headers)?;
    let if_match = if_match(&headers)?;
    let spec: PromoteSpec = parse_body(&body)?;
    let command = Promote {
        tenant,
        model,
        if_match,
        lora_int_id: spec.lora_int_id,
    };
    let view = s.exec(&c, command).await?;
    Ok(route_reply(StatusCode::OK, &c, &view))
}

async fn rollback(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let if_match = if_match(&headers)?;
    let command = Rollback {
        tenant,
        model,
        if_match,
    };
    let view = s.exec(&c, command).await?;
    Ok(route_reply(StatusCode::OK, &c, &view))
}

async fn get_rollout(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let view = s.read(&c, GetRollout { tenant, model }).await?;
    Ok(reply(StatusCode::OK, &c, &view))
}

async fn start_rollout(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let c = caller(&s, &headers)?;
    let command = StartRollout {
        tenant,
        model,
        if_match: if_match(&headers)?,
        spec: parse_body(&body)?,
    };
    let view = s.exec(&c, command).await?;
    Ok(reply(StatusCode::CREATED, &c, &view))
}

async fn change_rollout(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model, action)): Path<(String, String, String)>,
) -> Answer {
    let action = match action.as_str() {
        "pause" => Action::Pause,
        "resume" => Action::Resume,
        "abort" => Action::Abort,
        _ => {
            return Err(AdminError::new(
                AdminCode::NotFound,
                None,
                "no such admin endpoint".into(),
            ));
        }
    };
    let c = caller(&s, &headers)?;
    let command = ChangeRollout {
        tenant,
        model,
        action,
    };
    let view = s.exec(&c, command).await?;
    Ok(reply(StatusCode::OK, &c, &view))
}

async fn list_eval_sets(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let list = s.read(&c, ListEvalSets { tenant, model }).await?;
    Ok(reply(StatusCode::OK, &c, &list))
}

async fn register_eval_set(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
    body: Bytes,
) -> Answer {
    let c = caller(&s, &headers)?;
    let command = RegisterEvalSet {
        tenant,
        model,
        set: parse_body(&body)?,
    };
    let view = s.exec(&c, command).await?;
    Ok(reply(StatusCode::CREATED, &c, &view))
}

async fn revoke_token(State(s): State<AdminState>, headers: HeaderMap, body: Bytes) -> Answer {
    let c = caller(&s, &headers)?;
    let row = s.exec(&c, RevokeAdminToken(parse_body(&body)?)).await?;
    Ok(reply(StatusCode::OK, &c, &row))
}

async fn revoke_tenant_token(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Answer {
    let c = caller(&s, &headers)?;
    let row = s.exec(&c, RevokeTenantToken(parse_body(&body)?)).await?;
    Ok(reply(StatusCode::OK, &c, &row))
}

async fn revoke_own_token(State(s): State<AdminState>, headers: HeaderMap) -> Answer {
    let c = caller(&s, &headers)?;
    let row = s.exec(&c, RevokeOwnToken).await?;
    Ok(reply(StatusCode::OK, &c, &row))
}

async fn fleet_view(State(s): State<AdminState>, headers: HeaderMap) -> Answer {
    let c = caller(&s, &headers)?;
    let view = s.read(&c, FleetView).await?;
    Ok(reply(StatusCode::OK, &c, &view))
}

async fn audit_query(
    State(s): State<AdminState>,
    headers: HeaderMap,
    query: Result<Params<AuditFilter>, QueryRejection>,
) -> Answer {
    let c = caller(&s, &headers)?;
    let filter = filters(query)?;
    let csv = match filter.format.as_deref().unwrap_or("json") {
        "json" => {
            let page = s.read(&c, SearchAudit(filter)).await?;
            return Ok(reply(StatusCode::OK, &c, &page));
        }
        "csv" => true,
        "jsonl" => false,
        other => {
            return Err(AdminError::field(
                "format",
                format!("{other:?} is not json, jsonl or csv"),
            ));
        }
    };
    let stream = s.read(&c, ExportAudit { filter, csv }).await?;
    let content_type = if csv {
        "text/csv; charset=utf-8"
    } else {
        "application/x-ndjson"
    };
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    request_id(&mut r, &c);
    Ok(r)
}

/// A read whose filters are the query string: the change log, the audit
/// partitions, the usage report.
async fn read_query<Q>(
    State(s): State<AdminState>,
    headers: HeaderMap,
    query: Result<Params<Q>, QueryRejection>,
) -> Answer
where
    Q: Query + DeserializeOwned,
    Q::Output: Serialize,
{
    let c = caller(&s, &headers)?;
    let q = filters(query)?;
    let out = s.read(&c, q).await?;
    Ok(reply(StatusCode::OK, &c, &out))
}
