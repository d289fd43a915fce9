//! The stores' HTTP client, counting the attempts that fail in a way the
//! client retries (a transport error, a timeout, 429 or a 5xx): each is
//! retried with backoff until the fetch's retry budget or deadline ends.

use std::future::Future;
use std::pin::Pin;

use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};

/// Connects as object_store's default connector, counting per store.
#[derive(Debug)]
pub(crate) struct Counting {
    pub(crate) store: String,
}

impl HttpConnector for Counting {
    fn connect(&self, options: &object_store::ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(Counted {
            inner,
            store: self.store.clone(),
        }))
    }
}

#[derive(Debug)]
struct Counted {
    inner: HttpClient,
    store: String,
}

impl HttpService for Counted {
    fn call<'a, 'b>(
        &'a self,
        req: HttpRequest,
    ) -> Pin<Box<dyn Future<Output = Result<HttpResponse, HttpError>> + Send + 'b>>
    where
        'a: 'b,
    {
        Box::pin(async move {
            let answer = self.inner.execute(req).await;
            let transient = match &answer {
                Err(_) => true,
                Ok(r) => r.status().is_server_error() || r.status().as_u16() == 429,
            };
            if transient {
                metrics::counter!("lorafleet_artifact_store_transient_errors_total", "store" => self.store.clone())
                    .increment(1);
            }
            answer
        })
    }
}
