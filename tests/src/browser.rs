//! A real headless Chromium, driven over the W3C WebDriver protocol by
//! `chromedriver`, for the console's browser tests.
//!
//! The binaries come from `LORAFLEET_CHROMIUM` (default `/usr/bin/chromium`)
//! and `LORAFLEET_CHROMEDRIVER` (default `chromedriver` on the PATH);
//! Debian's `chromium` and `chromium-driver` packages provide both, and
//! `.ci/run` installs them when they are missing.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};

/// The W3C key of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver process and one browser session in it; both end when
/// this is dropped.
#[derive(Debug)]
pub struct Browser {
    driver: Child,
    base: String,
    http: reqwest::Client,
}

/// An element of the current page.
#[derive(Debug, Clone)]
pub struct Element(String);

impl Drop for Browser {
    fn drop(&mut self) {
        // The session's Chromium exits with its driver.
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    /// Starts chromedriver and a headless Chromium at desktop width.
    pub async fn start() -> Browser {
        let chromium =
            std::env::var("LORAFLEET_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let chromedriver =
            std::env::var("LORAFLEET_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        assert!(
            std::path::Path::new(&chromium).exists(),
            "no Chromium at {chromium}: install Debian's chromium and chromium-driver \
             (apt-get install chromium chromium-driver) or set LORAFLEET_CHROMIUM"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("starting {chromedriver}: {e} (install Debian's chromium-driver)")
            });
        let http = reqwest::Client::new();
        let root = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = http
                .get(format!("{root}/status"))
                .send()
                .await
                .ok()
                .filter(|r| r.status().is_success());
            if ready.is_some() {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver never became ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1440,1000",
                         "--hide-scrollbars"],
            },
        }}});
        let created: Value = http
            .post(format!("{root}/session"))
            .json(&caps)
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("a JSON session");
        let id = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {created}"))
            .to_owned();
        Browser {
            driver,
            base: format!("{root}/session/{id}"),
            http,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let v: Value = req
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("JSON from chromedriver");
        v["value"].clone()
    }

    async fn checked(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let v = self.call(method, path, body).await;
        if let Some(e) = v.get("error") {
            panic!("WebDriver {path}: {e}: {}", v["message"]);
        }
        v
    }

    pub async fn goto(&self, url: &str) {
        self.checked(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    pub async fn url(&self) -> String {
        self.checked(reqwest::Method::GET, "/url", None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Every element matching `css`, now.
    pub async fn all(&self, css: &str) -> Vec<Element> {
        let v = self
            .checked(
                reqwest::Method::POST,
                "/elements",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e[ELEMENT].as_str().map(|id| Element(id.to_owned())))
            .collect()
    }

    /// The first element matching `css`, waiting up to 10 s for it.
    pub async fn find(&self, css: &str) -> Element {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(e) = self.all(css).await.into_iter().next() {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "no element {css:?} on {}; the page:\n{}",
                self.url().await,
                self.text("body").await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The visible text of the first element matching `css` ("" if none).
    /// A live part of the page may replace the element between finding
    /// and reading it; then it is found again.
    pub async fn text(&self, css: &str) -> String {
        for _ in 0..20 {
            let Some(e) = self.all(css).await.into_iter().next() else {
                return String::new();
            };
            let v = self
                .call(
                    reqwest::Method::GET,
                    &format!("/element/{}/text", e.0),
                    None,
                )
                .await;
            match v.get("error").and_then(Value::as_str) {
                Some("stale element reference") => continue,
                Some(other) => panic!("WebDriver text of {css}: {other}: {}", v["message"]),
                None => return v.as_str().unwrap_or_default().to_owned(),
            }
        }
        panic!("{css} kept being replaced while it was read")
    }

    pub async fn text_of(&self, e: &Element) -> String {
        self.checked(
            reqwest::Method::GET,
            &format!("/element/{}/text", e.0),
            None,
        )
        .await
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    pub async fn attribute(&self, e: &Element, name: &str) -> Option<String> {
        self.checked(
            reqwest::Method::GET,
            &format!("/element/{}/attribute/{name}", e.0),
            None,
        )
        .await
        .as_str()
        .map(str::to_owned)
    }

    /// Clicks a link or a submit button and waits for the page it leads
    /// to: until the old document is gone and the new one has loaded, so
    /// that what is read next is never the page before the click.
    pub async fn click(&self, css: &str) {
        let e = self.find(css).await;
        self.run(
            "window.__lorafleet_old_page = true; return true;",
            json!([]),
        )
        .await;
        self.checked(
            reqwest::Method::POST,
            &format!("/element/{}/click", e.0),
            Some(json!({})),
        )
        .await;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            // A script that runs while the old document unloads can be cut
            // off ("script timeout"): that is the navigation still under
            // way, so it is asked again, not failed.
            let state = self
                .call(
                    reqwest::Method::POST,
                    "/execute/sync",
                    Some(json!({
                        "script": "return window.__lorafleet_old_page ? 'old' : document.readyState;",
                        "args": [],
                    })),
                )
                .await;
            if state == "complete" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "clicking {css} led to no new page"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Clears the field matching `css` and types `text` into it.
    pub async fn fill(&self, css: &str, text: &str) {
        let e = self.find(css).await;
        self.checked(
            reqwest::Method::POST,
            &format!("/element/{}/clear", e.0),
            Some(json!({})),
        )
        .await;
        self.checked(
            reqwest::Method::POST,
            &format!("/element/{}/value", e.0),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// Runs `script` in the page; an `async` body may `await` and `return`.
    pub async fn run(&self, script: &str, args: Value) -> Value {
        self.checked(
            reqwest::Method::POST,
            "/execute/async",
            Some(json!({
                "script": format!(
                    "const done = arguments[arguments.length - 1];
                     (async () => {{ {script} }})(...Array.from(arguments).slice(0, -1))
                       .then(done, e => done('script failed: ' + e));"
                ),
                "args": args,
            })),
        )
        .await
    }

    /// Opens a new tab and switches to it; returns the old tab's handle.
    pub async fn new_tab(&self) -> String {
        let old = self.checked(reqwest::Method::GET, "/window", None).await;
        let tab = self
            .checked(
                reqwest::Method::POST,
                "/window/new",
                Some(json!({"type": "tab"})),
            )
            .await;
        self.switch_to(tab["handle"].as_str().expect("a tab handle"))
            .await;
        old.as_str().expect("a window handle").to_owned()
    }

    pub async fn switch_to(&self, handle: &str) {
        self.checked(
            reqwest::Method::POST,
            "/window",
            Some(json!({ "handle": handle })),
        )
        .await;
    }

    /// The cookies the browser holds for the current page.
    pub async fn cookies(&self) -> Vec<Value> {
        self.checked(reqwest::Method::GET, "/cookie", None)
            .await
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// A PNG of the whole page at the window's width.
    pub async fn screenshot(&self, path: &std::path::Path) {
        // Grow the window to the page's height so the shot holds it all.
        let height = self
            .run("return document.documentElement.scrollHeight;", json!([]))
            .await
            .as_u64()
            .unwrap_or(1000)
            .clamp(600, 4000);
        self.checked(
            reqwest::Method::POST,
            "/window/rect",
            Some(json!({"width": 1440, "height": height + 120})),
        )
        .await;
        let png = self
            .checked(reqwest::Method::GET, "/screenshot", None)
            .await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("base64 PNG"))
            .expect("a base64 screenshot");
        std::fs::write(path, bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        self.checked(
            reqwest::Method::POST,
            "/window/rect",
            Some(json!({"width": 1440, "height": 1000})),
        )
        .await;
    }
}
