//! A request's trail: its audit row and metrics, filled in as it goes, and
//! recorded exactly once (also when the handler is dropped).

use super::*;
use crate::audit::AuditStatus;

/// What the audit row and metrics need, filled in as the request proceeds.
///
/// It holds the request's audit [`Ticket`]: a trail dropped without
/// [`Trail::close`] (the client went away and the handler's future was
/// dropped) still records its row, as `cancelled`.
pub(super) struct Trail {
    pub(super) record: AuditRecord,
    pub(super) started: Instant,
    pub(super) tenant_name: String,
    pub(super) adapter_label: String,
    pub(super) ticket: Option<Ticket>,
    /// Whether the tenant's metrics have series of their own.
    pub(super) series: Arc<super::series::TenantSeries>,
    /// Each choice's device and adapter-load time so far, from its latest
    /// delta.
    spent: Vec<(Duration, Duration)>,
    /// The tenant's tokens-per-minute reservation, settled to the tokens
    /// the request used when its row is written, however it ends.
    pub(super) tokens: Option<crate::ratelimit::Reservation>,
}

/// HTTP status recorded for a request whose client closed the connection
/// before any answer (nginx's convention; no response was sent).
pub(super) const CLIENT_CLOSED: u16 = 499;

impl Drop for Trail {
    fn drop(&mut self) {
        if self.ticket.is_some() {
            let code = StatusCode::from_u16(CLIENT_CLOSED).expect("a valid status");
            // The row is queued at once; nobody is left to wait for it.
            let _ = self.finish(AuditStatus::Cancelled, code, Some("client_closed"));
        }
    }
}

impl Trail {
    pub(super) fn new(
        request_id: Uuid,
        ticket: Ticket,
        series: Arc<super::series::TenantSeries>,
    ) -> Trail {
        Trail {
            record: AuditRecord::refused(request_id, Utc::now()),
            started: Instant::now(),
            tenant_name: String::new(),
            adapter_label: String::new(),
            ticket: Some(ticket),
            series,
            spent: Vec::new(),
            tokens: None,
        }
    }

    /// Choice `index`'s device and load time so far: the row keeps their
    /// sum over the choices as they come, so a request cut before its end
    /// (a client that went away, a timeout) still records what it used up
    /// to its last delta. The choices' `Finished` set the final figures.
    pub(super) fn spent(&mut self, index: usize, device: Duration, load: Duration) {
        if self.spent.len() <= index {
            self.spent
                .resize(index + 1, (Duration::ZERO, Duration::ZERO));
        }
        self.spent[index] = (device, load);
        let device: Duration = self.spent.iter().map(|s| s.0).sum();
        let load: Duration = self.spent.iter().map(|s| s.1).sum();
        self.record.device_us = Some(crate::audit::micros(device));
        self.record.load_us = Some(crate::audit::micros(load));
    }

    /// The `tenant` and `adapter` labels of the request's metrics: its own
    /// when its tenant is named, else `other` ([`super::series`]).
    pub(super) fn labels(&self, named: bool) -> [(&'static str, String); 2] {
        let (tenant, adapter) = match named {
            true => (self.tenant_name.clone(), self.adapter_label.clone()),
            false => (super::series::OTHER.into(), super::series::OTHER.into()),
        };
        [("tenant", tenant), ("adapter", adapter)]
    }

    /// Gives the row's place back unwritten: the request is recorded
    /// elsewhere (a failed authentication, in its source's aggregate).
    pub(super) fn discard(&mut self) {
        self.ticket = None;
    }

    /// Records what a refused body said its `model` and `user` were, made
    /// safe later like every field.
    pub(super) fn note_refused_body(&mut self, body: &[u8]) {
        let Some((model, user)) = openai::refused_echo(body) else {
            return;
        };
        if let Some(m) = model {
            self.record.model_name = m;
        }
        if user.is_some() {
            self.record.end_user = user;
        }
    }

    pub(super) fn resolved(&mut self, r: &Resolved) {
        self.record.route_id = Some(r.route.id);
        self.record.route_revision = Some(r.route.revision);
        self.record.base_hash = Some(r.route.base_hash.to_string());
        match &r.adapter {
            Some(a) => {
                self.record.lora_int_id = Some(a.lora_int_id.to_registry());
                self.record.adapter_name = Some(a.name.clone());
                self.record.adapter_version = Some(a.version as i32);
                self.adapter_label = format!("{}@{}", a.name, a.version);
            }
            None => self.adapter_label = "base".into(),
        }
    }

    /// Finishes the row and the metrics; the result resolves when the row
    /// is durable.
    pub(super) fn close(
        mut self,
        status: AuditStatus,
        http: StatusCode,
        code: Option<&str>,
    ) -> Option<Durable> {
        self.finish(status, http, code)
    }

    pub(super) fn finish(
        &mut self,
        status: AuditStatus,
        http: StatusCode,
        code: Option<&str>,
    ) -> Option<Durable> {
        let ticket = self.ticket.take()?;
        if let Some(reservation) = self.tokens.take() {
            let used = self.record.prompt_tokens.max(0) + self.record.completion_tokens.max(0);
            reservation.settle(used as u64);
        }
        self.record.completed_at = Utc::now();
        self.record.latency_us = self.started.elapsed().as_micros() as i64;
        self.record.status = status;
        self.record.http_status = http.as_u16() as i16;
        self.record.error_code = code.map(str::to_owned);
        if status != AuditStatus::Ok {
            self.record.finish_reason = None;
        }
        let device = Duration::from_micros(self.record.device_us.unwrap_or(0).max(0) as u64);
        let labels = self.labels(self.series.charge(&self.tenant_name, device));
        let [tenant, adapter] = labels.clone();
        metrics::counter!(
            "lorafleet_gateway_requests_total",
            &[tenant, adapter, ("status", status.as_str().to_owned())]
        )
        .increment(1);
        metrics::histogram!("lorafleet_gateway_request_duration_seconds", &labels)
            .record(self.started.elapsed().as_secs_f64());
        if let Some(ttft) = self.record.ttft_us {
            metrics::histogram!("lorafleet_gateway_time_to_first_token_seconds", &labels)
                .record(ttft as f64 / 1e6);
        }
        Some(ticket.record(self.record.clone()))
    }
}

/// Waits for a row to be durable; false if it is not (then the answer must
/// not be a success).
pub(super) async fn durable(d: Option<Durable>) -> bool {
    match d {
        Some(d) => d.wait().await,
        None => false,
    }
}

pub(super) fn audit_unavailable(u: Unavailable) -> ApiError {
    ApiError::AuditUnavailable {
        reason: u.to_string(),
    }
}

pub(super) fn row_not_durable() -> ApiError {
    ApiError::RowNotDurable
}

/// Every completion response carries its request id, the key of its row.
pub(super) fn with_request_id(mut r: Response, request_id: Uuid) -> Response {
    if let Ok(v) = HeaderValue::from_str(&request_id.to_string()) {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}
