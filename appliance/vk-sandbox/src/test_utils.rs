//! An in-process fake sandboxd (axum on a loopback port) with settable failures, for the
//! client and provider unit tests. It speaks the shapes of `docs/sandboxd.md` §5.1
//! through sandboxd's own body types ([`sandboxd_api`]):
//! node routes check the node token when one is set; release checks the claim's own token and
//! answers `404` for an unknown id or a wrong token.
#![allow(clippy::unwrap_used)] // test support: a poisoned lock or a failed bind is the failure report

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use futures::StreamExt as _;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use sandboxd_api::{
    ClaimReply, ClaimRequest, ErrorBody, Grant, Info, Key, PeerReport, Peers, PoolInfo, SandboxList, SandboxRow,
};

/// How the fake answers `POST /v1/claim`.
#[derive(Debug, Clone)]
pub enum ClaimMode {
    /// Grant a claim.
    Grant,
    /// `429` (no capacity).
    TooMany,
    /// `200 {"redirect": [...]}`.
    Redirect,
    /// This status with this `{"error"}` text.
    Fail(u16, &'static str),
    /// Grant the claim, then answer `500` (a grant whose answer is lost).
    LoseAnswer,
}

/// A claim the fake holds.
#[derive(Debug, Clone)]
pub struct FakeClaim {
    pub token: String,
    pub claim_ref: Option<String>,
    pub deadline: Timestamp,
    /// Its pool (`rt/none/small` when unset).
    pub key: Option<Key>,
}

#[derive(Debug)]
struct FakeState {
    node_token: Option<String>,
    owner_addr: String,
    claim_mode: ClaimMode,
    list_fails: bool,
    release_fails: bool,
    list_padding: usize,
    next: u64,
    claims: BTreeMap<String, FakeClaim>,
    claim_bodies: Vec<serde_json::Value>,
    releases: Vec<String>,
    lists: usize,
    /// Sandbox id → (CPU ns, working-set bytes) its `…/stats` reports.
    usage: BTreeMap<String, (u64, u64)>,
    /// The pools `/v1/info` lists.
    pools: Vec<PoolInfo>,
    info_fails: bool,
    draining: bool,
    /// `PUT /v1/peers` bodies received.
    peer_reports: Vec<PeerReport>,
}

/// The fake; dropping it stops the server.
pub struct FakeSandboxd {
    state: Arc<Mutex<FakeState>>,
    addr: std::net::SocketAddr,
    server: tokio::task::JoinHandle<()>,
    https: bool,
}

impl Drop for FakeSandboxd {
    fn drop(&mut self) {
        self.server.abort();
    }
}

type S = State<Arc<Mutex<FakeState>>>;

fn err(status: u16, msg: &str) -> Response {
    (StatusCode::from_u16(status).unwrap(), Json(ErrorBody::new(msg))).into_response()
}

fn bearer(h: &HeaderMap) -> Option<String> {
    let v = h.get("authorization")?.to_str().ok()?;
    v.strip_prefix("Bearer ").map(str::to_owned)
}

/// The refusal of a node route, if any.
fn node_auth(st: &FakeState, h: &HeaderMap) -> Option<Response> {
    match (&st.node_token, bearer(h)) {
        (None, _) => None,
        (Some(_), None) => Some(err(401, "missing bearer token")),
        (Some(t), Some(b)) if *t == b => None,
        (Some(_), Some(_)) => Some(err(401, "invalid api token")),
    }
}

async fn claim(State(s): S, h: HeaderMap, Json(body): Json<serde_json::Value>) -> Response {
    let mut st = s.lock().unwrap();
    if let Some(r) = node_auth(&st, &h) {
        return r;
    }
    st.claim_bodies.push(body.clone());
    let lose_answer = matches!(st.claim_mode, ClaimMode::LoseAnswer);
    match st.claim_mode.clone() {
        ClaimMode::Grant | ClaimMode::LoseAnswer => {}
        ClaimMode::TooMany => return err(429, "no warm VM for this pool"),
        ClaimMode::Redirect => {
            return Json(ClaimReply { redirect: vec!["10.0.0.9:7777".into()], ..ClaimReply::default() }).into_response()
        }
        ClaimMode::Fail(code, msg) => return err(code, msg),
    }
    st.next += 1;
    let id = format!("sb_{:016x}", st.next);
    let token = format!("{:032x}", st.next * 7919);
    let Ok(req) = serde_json::from_value::<ClaimRequest>(body) else {
        return err(400, "invalid request body");
    };
    let ttl = match req.ttl_seconds.unwrap_or(0) {
        0 => 300,
        t => t.min(86_400),
    };
    let deadline = Timestamp::now() + SignedDuration::from_secs(ttl);
    let key = Key {
        template: req.template.clone(),
        net: req.net.clone().unwrap_or_else(|| "none".into()),
        size: req.size.clone().unwrap_or_else(|| "small".into()),
    };
    st.claims
        .insert(id.clone(), FakeClaim { token: token.clone(), claim_ref: req.claim_ref, deadline, key: Some(key) });
    if lose_answer {
        return err(500, "the answer was lost");
    }
    let grant =
        Grant { id, token, deadline: deadline.to_string(), owner_addr: st.owner_addr.clone(), ..Grant::default() };
    // A field this client does not know (vk-sandbox's `net_route`) is read past.
    let mut v = serde_json::to_value(grant).unwrap();
    v["net_route"] = "ignored".into();
    Json(v).into_response()
}

/// The listing row of a held claim (no token).
fn row(id: &str, c: &FakeClaim) -> SandboxRow {
    SandboxRow {
        id: id.to_owned(),
        key: c.key.clone().unwrap_or_else(|| Key { template: "rt".into(), net: "none".into(), size: "small".into() }),
        deadline: c.deadline.to_string(),
        claimed_at: c.deadline.to_string(),
        hibernated: false,
        claim_ref: c.claim_ref.clone(),
        ..SandboxRow::default()
    }
}

async fn release(State(s): S, Path(id): Path<String>, h: HeaderMap) -> Response {
    let mut st = s.lock().unwrap();
    let Some(tok) = bearer(&h) else {
        return err(401, "missing bearer token");
    };
    match st.claims.get(&id) {
        Some(c) if c.token == tok => {}
        _ => return err(404, "sandbox not found"),
    }
    if st.release_fails {
        return err(500, "release failed");
    }
    st.claims.remove(&id);
    st.releases.push(id);
    StatusCode::NO_CONTENT.into_response()
}

async fn list(State(s): S, h: HeaderMap, Query(q): Query<BTreeMap<String, String>>) -> Response {
    let mut st = s.lock().unwrap();
    if let Some(r) = node_auth(&st, &h) {
        return r;
    }
    st.lists += 1;
    if st.list_fails {
        return err(500, "list failed");
    }
    let want = q.get("claim_ref").filter(|r| !r.is_empty());
    let sandboxes = st
        .claims
        .iter()
        .filter(|(_, c)| want.is_none() || c.claim_ref.as_ref() == want)
        .map(|(id, c)| row(id, c))
        .collect();
    let mut body = serde_json::to_value(SandboxList { sandboxes }).unwrap();
    if st.list_padding > 0 {
        body["padding"] = "x".repeat(st.list_padding).into();
    }
    Json(body).into_response()
}

async fn get_one(State(s): S, Path(id): Path<String>, h: HeaderMap) -> Response {
    let st = s.lock().unwrap();
    if let Some(r) = node_auth(&st, &h) {
        return r;
    }
    let Some(c) = st.claims.get(&id) else {
        return err(404, "sandbox not found");
    };
    let mut row = row(&id, c);
    // sandboxd adds the token only for the root token (none configured: never).
    if st.node_token.is_some() {
        row.token = Some(c.token.clone());
    }
    Json(row).into_response()
}

/// `GET …/console`: a sandbox route (the claim's token or the node token); the query decoded
/// and checked as sandboxd does; the body echoes the raw query, sends `line-1`, and `line-2`
/// half a second later.
async fn console(
    State(s): S,
    Path(id): Path<String>,
    h: HeaderMap,
    raw: axum::extract::RawQuery,
    q: Result<Query<kstream::logs::LogQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    {
        let st = s.lock().unwrap();
        let Some(tok) = bearer(&h) else {
            return err(401, "missing bearer token");
        };
        match st.claims.get(&id) {
            Some(c) if c.token == tok || st.node_token.as_deref() == Some(tok.as_str()) => {}
            _ => return err(404, "sandbox not found"),
        }
    }
    let Ok(Query(q)) = q else {
        return err(400, "invalid console query");
    };
    if let Err(e) = q.validate() {
        return err(400, &e.to_string());
    }
    let head = format!("query {}\n", raw.0.unwrap_or_default());
    let chunks = futures::stream::iter([head, "line-1\n".to_owned()]).chain(futures::stream::once(async {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        "line-2\n".to_owned()
    }));
    axum::body::Body::from_stream(chunks.map(Ok::<_, std::io::Error>)).into_response()
}

async fn stats(State(s): S, Path(id): Path<String>, h: HeaderMap) -> Response {
    let st = s.lock().unwrap();
    if let Some(refused) = node_auth(&st, &h) {
        return refused;
    }
    if !st.claims.contains_key(&id) {
        return err(404, "no such sandbox");
    }
    let usage = st.usage.get(&id).copied();
    Json(sandboxd_api::Stats {
        id,
        cpu_count: 1,
        mem_total_bytes: 512 << 20,
        measured_at: "2030-01-01T00:00:10Z".into(),
        cpu_usage_nanos: usage.map(|u| u.0),
        memory_working_set_bytes: usage.map(|u| u.1),
        ..Default::default()
    })
    .into_response()
}

async fn info(State(s): S, h: HeaderMap) -> Response {
    let st = s.lock().unwrap();
    if let Some(r) = node_auth(&st, &h) {
        return r;
    }
    if st.info_fails {
        return err(500, "info failed");
    }
    Json(Info { claimed: st.claims.len(), pools: st.pools.clone(), draining: st.draining, ..Info::default() })
        .into_response()
}

/// `PUT /v1/peers` (root): recorded; answers the addresses as sandboxd does.
async fn put_peers(State(s): S, h: HeaderMap, Json(report): Json<PeerReport>) -> Response {
    let mut st = s.lock().unwrap();
    if let Some(r) = node_auth(&st, &h) {
        return r;
    }
    let peers = report.peers.iter().map(|p| p.addr.clone()).collect();
    st.peer_reports.push(report);
    Json(Peers { peers }).into_response()
}

impl FakeSandboxd {
    /// Starts the fake on a loopback port; `node_token` guards the node routes.
    pub async fn start(node_token: Option<&str>) -> FakeSandboxd {
        Self::start_with(node_token, None).await
    }

    /// [`FakeSandboxd::start`] serving HTTPS with `tls` (through `httpd::serve`, as sandboxd).
    pub async fn start_tls(node_token: Option<&str>, tls: Arc<rustls::ServerConfig>) -> FakeSandboxd {
        Self::start_with(node_token, Some(tls)).await
    }

    async fn start_with(node_token: Option<&str>, tls: Option<Arc<rustls::ServerConfig>>) -> FakeSandboxd {
        let state = Arc::new(Mutex::new(FakeState {
            node_token: node_token.map(str::to_owned),
            owner_addr: "10.1.2.3:7777".into(),
            claim_mode: ClaimMode::Grant,
            list_fails: false,
            release_fails: false,
            list_padding: 0,
            next: 0,
            claims: BTreeMap::new(),
            claim_bodies: Vec::new(),
            releases: Vec::new(),
            lists: 0,
            usage: BTreeMap::new(),
            pools: Vec::new(),
            info_fails: false,
            draining: false,
            peer_reports: Vec::new(),
        }));
        let app = Router::new()
            .route("/v1/claim", post(claim))
            .route("/v1/sandboxes/{id}/release", post(release))
            .route("/v1/sandboxes", get(list))
            .route("/v1/sandboxes/{id}", get(get_one))
            .route("/v1/sandboxes/{id}/console", get(console))
            .route("/v1/sandboxes/{id}/stats", get(stats))
            .route("/v1/info", get(info))
            .route("/v1/peers", put(put_peers))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let https = tls.is_some();
        let server = tokio::spawn(async move {
            let opts = httpd::ServeOptions {
                name: "fake sandboxd",
                limits: httpd::Limits::default(),
                protocol: httpd::Protocol::Http1,
                tls,
            };
            httpd::serve(listener, app, opts, Arc::default(), std::future::pending()).await;
        });
        FakeSandboxd { state, addr, server, https }
    }

    fn st(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state.lock().unwrap()
    }

    /// `http://127.0.0.1:<port>` (`https://` when serving TLS).
    pub fn url(&self) -> String {
        format!("{}://{}", if self.https { "https" } else { "http" }, self.addr)
    }
    /// The `owner_addr` grants carry.
    pub fn owner_addr(&self) -> String {
        self.st().owner_addr.clone()
    }
    pub fn set_owner_addr(&self, a: &str) {
        self.st().owner_addr = a.to_owned();
    }
    /// What `…/stats` reports for sandbox `id` (CPU ns, working-set bytes).
    pub fn set_usage(&self, id: &str, cpu_nanos: u64, working_set: u64) {
        self.st().usage.insert(id.to_owned(), (cpu_nanos, working_set));
    }

    pub fn set_claim_mode(&self, m: ClaimMode) {
        self.st().claim_mode = m;
    }
    pub fn set_list_fails(&self, f: bool) {
        self.st().list_fails = f;
    }
    pub fn set_release_fails(&self, f: bool) {
        self.st().release_fails = f;
    }
    pub fn set_list_padding(&self, n: usize) {
        self.st().list_padding = n;
    }
    /// Whether the fake still holds claim `id` (its VM is alive).
    pub fn holds(&self, id: &str) -> bool {
        self.st().claims.contains_key(id)
    }
    /// Ids of live claims.
    pub fn live(&self) -> Vec<String> {
        self.st().claims.keys().cloned().collect()
    }
    /// The claim `id`, if held.
    pub fn claim(&self, id: &str) -> Option<FakeClaim> {
        self.st().claims.get(id).cloned()
    }
    /// Inserts a live claim (as if granted earlier).
    pub fn insert(&self, id: &str, token: &str, claim_ref: Option<&str>, deadline: Timestamp) {
        self.st().claims.insert(
            id.to_owned(),
            FakeClaim { token: token.to_owned(), claim_ref: claim_ref.map(str::to_owned), deadline, key: None },
        );
    }
    /// Drops claim `id` as sandboxd's reaper would.
    pub fn reap(&self, id: &str) {
        self.st().claims.remove(id);
    }
    /// The last claim request body.
    pub fn last_claim_body(&self) -> Option<serde_json::Value> {
        self.st().claim_bodies.last().cloned()
    }
    /// How many claim requests arrived.
    pub fn claim_count(&self) -> usize {
        self.st().claim_bodies.len()
    }
    /// Ids released so far (successful releases only).
    pub fn releases(&self) -> Vec<String> {
        self.st().releases.clone()
    }
    /// The pools `/v1/info` lists.
    pub fn set_pools(&self, pools: Vec<PoolInfo>) {
        self.st().pools = pools;
    }
    /// Makes `/v1/info` answer 500.
    pub fn set_info_fails(&self, f: bool) {
        self.st().info_fails = f;
    }
    /// Makes `/v1/info` say the node is draining.
    pub fn set_draining(&self, d: bool) {
        self.st().draining = d;
    }
    /// The `PUT /v1/peers` bodies received so far.
    pub fn peer_reports(&self) -> Vec<PeerReport> {
        self.st().peer_reports.clone()
    }
    /// Inserts a live claim of pool `key` (as if granted earlier).
    pub fn insert_in(&self, id: &str, claim_ref: Option<&str>, key: Key) {
        let deadline = Timestamp::now() + SignedDuration::from_secs(600);
        self.st().claims.insert(
            id.to_owned(),
            FakeClaim { token: format!("tok-{id}"), claim_ref: claim_ref.map(str::to_owned), deadline, key: Some(key) },
        );
    }
    /// How many listings were served (or refused).
    pub fn list_count(&self) -> usize {
        self.st().lists
    }
}
