//! Who may use the kubelet port, decided as a kubelet in webhook mode decides it
//! (`--anonymous-auth=false`, `--client-ca-file`, `--authentication-token-webhook`,
//! `--authorization-mode=Webhook`; upstream `pkg/kubelet/server/auth.go`).
//!
//! # Expected flow (every request, `/healthz` included)
//! 1. **Authenticate.** A client certificate that verifies against the cluster CA is the user
//!    `CN` in groups `O` ([`x509`]). Otherwise an `Authorization: Bearer <token>` header is
//!    sent to the API server as a `TokenReview` ([`review`]), its answer cached by a digest of
//!    the token (authenticated 2 min, rejected 30 s). Neither → **401**.
//! 2. **Authorize.** A `SubjectAccessReview` for resource `nodes`, name = this node, the
//!    subresource and verb of [`attributes`], cached per (user, verb, subresource) (allowed
//!    5 min, denied 30 s). Denied → **403** naming the user, verb and subresource.
//! 3. The route runs.
//!
//! # Guarantees
//! * Fails closed: no CA configured → no certificate is accepted; a review that cannot be made
//!   (API server unreachable, timing out, refusing the node) → **503**, never cached; a method
//!   with no API verb → 403 without a review.
//! * Bounded: each cache holds at most [`AuthConfig::cache_entries`]; tokens longer than
//!   [`AuthConfig::max_token_bytes`] are refused unread; at most
//!   [`AuthConfig::max_concurrent_reviews`] review calls are in flight (a request waits up to
//!   [`AuthConfig::review_timeout`] for a slot, then gets 503).
//! * Tokens are never logged or kept: caches are keyed by SHA-256 digests.
//!
//! # Status codes
//! 401 `Unauthorized` carries no detail (as the kubelet); 403 names user, verb and
//! subresource; 503 says the node could not ask the API server. The kubelet answers an
//! authentication error with 401 and an authorization error with 500; we answer both with 503
//! so a client can tell an outage from bad credentials.

pub mod attributes;
pub mod cache;
pub mod review;
pub mod x509;

use attributes::Attributes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use cache::TtlCache;
use review::{AccessVerdict, ReviewError, Reviewer, TokenVerdict};
use rustls::pki_types::CertificateDer;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tracing::Instrument as _;
use x509::{CertError, ClientCa};

/// An authenticated identity (authentication.k8s.io `UserInfo`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct UserInfo {
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

/// Cache lifetimes and caps (the kubelet's defaults where it has them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthConfig {
    /// How long an authenticated token is trusted without asking again
    /// (`--authentication-token-webhook-cache-ttl`, 2 min).
    pub token_ttl: Duration,
    /// How long a rejected token stays rejected (30 s).
    pub token_rejected_ttl: Duration,
    /// How long an allowed request stays allowed (`--authorization-webhook-cache-authorized-ttl`, 5 min).
    pub allowed_ttl: Duration,
    /// How long a denied request stays denied (`--authorization-webhook-cache-unauthorized-ttl`, 30 s).
    pub denied_ttl: Duration,
    /// Entries per cache (tokens; access decisions).
    pub cache_entries: usize,
    /// Longer bearer tokens are refused without a review.
    pub max_token_bytes: usize,
    /// Review calls in flight at most.
    pub max_concurrent_reviews: usize,
    /// How long one review (waiting for a slot included) may take.
    pub review_timeout: Duration,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            token_ttl: Duration::from_secs(120),
            token_rejected_ttl: Duration::from_secs(30),
            allowed_ttl: Duration::from_secs(300),
            denied_ttl: Duration::from_secs(30),
            cache_entries: 4096,
            max_token_bytes: 16 * 1024,
            max_concurrent_reviews: 32,
            review_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a request is refused. Its status comes from [`AuthError::status`], one per variant.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("no client certificate and no bearer token (anonymous requests are refused)")]
    Anonymous,
    #[error("the client certificate is not an identity")]
    Certificate(#[source] CertError),
    #[error("the Authorization header is not `Bearer <token>`")]
    MalformedAuthorization,
    #[error("the bearer token is longer than {max} bytes")]
    TokenTooLong { max: usize },
    #[error("the API server does not authenticate the bearer token")]
    TokenRejected,
    #[error("{user} sent {method}, which has no API verb")]
    NoVerb { user: String, method: Method },
    #[error("Forbidden (user={user}, verb={verb}, resource=nodes, subresource={subresource})")]
    Forbidden { user: String, verb: &'static str, subresource: &'static str, reason: String },
    #[error("the node could not ask the API server")]
    Review(#[source] ReviewError),
    #[error("{max} reviews are in flight; none finished within {waited:?}")]
    Busy { max: usize, waited: Duration },
}

impl AuthError {
    /// The HTTP status of each refusal.
    pub fn status(&self) -> StatusCode {
        match self {
            AuthError::Anonymous
            | AuthError::Certificate(_)
            | AuthError::MalformedAuthorization
            | AuthError::TokenTooLong { .. }
            | AuthError::TokenRejected => StatusCode::UNAUTHORIZED,
            AuthError::NoVerb { .. } | AuthError::Forbidden { .. } => StatusCode::FORBIDDEN,
            AuthError::Review(_) | AuthError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// What the client is told (a 401 says nothing more; the log has the cause).
    fn public_message(&self) -> String {
        match self {
            AuthError::Anonymous
            | AuthError::Certificate(_)
            | AuthError::MalformedAuthorization
            | AuthError::TokenTooLong { .. }
            | AuthError::TokenRejected => "Unauthorized".into(),
            AuthError::NoVerb { user, method } => {
                format!("Forbidden (user={user}, method={method} has no API verb, resource=nodes)")
            }
            AuthError::Forbidden { .. } => self.to_string(),
            AuthError::Review(_) | AuthError::Busy { .. } => {
                "Service Unavailable: this node cannot review credentials with the API server now; retry".into()
            }
        }
    }
}

impl IntoResponse for AuthError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), format!("{}\n", self.public_message())).into_response();
        if self.status() == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        response
    }
}

/// Authentication and authorization for one node's kubelet port.
pub struct KubeletAuth {
    node: String,
    ca: ClientCa,
    reviewer: Arc<dyn Reviewer>,
    config: AuthConfig,
    tokens: TtlCache<TokenVerdict>,
    access: TtlCache<AccessVerdict>,
    reviews: Semaphore,
}

impl std::fmt::Debug for KubeletAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeletAuth")
            .field("node", &self.node)
            .field("client_ca", &self.ca.is_configured())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KubeletAuth {
    pub fn new(node: &str, ca: ClientCa, reviewer: Arc<dyn Reviewer>, config: AuthConfig) -> KubeletAuth {
        KubeletAuth {
            node: node.to_owned(),
            tokens: TtlCache::new(config.cache_entries),
            access: TtlCache::new(config.cache_entries),
            reviews: Semaphore::new(config.max_concurrent_reviews.max(1)),
            ca,
            reviewer,
            config,
        }
    }

    /// The client CA (its handshake verifier goes into the TLS configuration).
    pub fn client_ca(&self) -> &ClientCa {
        &self.ca
    }

    /// Entries in the (token, access) caches.
    pub fn cached(&self) -> (usize, usize) {
        (self.tokens.len(), self.access.len())
    }

    /// Who sent a request with `certificates` (from the TLS handshake, leaf first) and this
    /// `Authorization` header. A certificate that verifies wins; one that does not still lets a
    /// bearer token decide (the union of authenticators the kubelet runs).
    pub async fn authenticate(
        &self,
        certificates: &[CertificateDer<'static>],
        authorization: Option<&HeaderValue>,
    ) -> Result<UserInfo, AuthError> {
        let cert_error = if certificates.is_empty() {
            None
        } else {
            match self.ca.identify(certificates) {
                Ok(user) => return Ok(user),
                Err(e) => Some(e),
            }
        };
        match (bearer(authorization)?, cert_error) {
            (Some(token), _) => self.authenticate_token(token).await,
            (None, Some(e)) => Err(AuthError::Certificate(e)),
            (None, None) => Err(AuthError::Anonymous),
        }
    }

    async fn authenticate_token(&self, token: &str) -> Result<UserInfo, AuthError> {
        if token.len() > self.config.max_token_bytes {
            return Err(AuthError::TokenTooLong { max: self.config.max_token_bytes });
        }
        let key = cache::key([token.as_bytes()]);
        let verdict = match self.tokens.get(&key, Instant::now()) {
            Some(v) => v,
            None => {
                let v = self.with_slot(self.reviewer.review_token(token)).await?;
                let ttl = match v {
                    TokenVerdict::Authenticated(_) => self.config.token_ttl,
                    TokenVerdict::Rejected => self.config.token_rejected_ttl,
                };
                self.tokens.insert(key, v.clone(), ttl, Instant::now());
                v
            }
        };
        match verdict {
            TokenVerdict::Authenticated(user) => Ok(user),
            TokenVerdict::Rejected => Err(AuthError::TokenRejected),
        }
    }

    /// Whether `user` may send `method path` to this node.
    pub async fn authorize(&self, user: &UserInfo, method: &Method, path: &str) -> Result<Attributes, AuthError> {
        let attrs = Attributes::of(method, path, &self.node)
            .ok_or_else(|| AuthError::NoVerb { user: user.username.clone(), method: method.clone() })?;
        let key = access_key(user, &attrs);
        let verdict = match self.access.get(&key, Instant::now()) {
            Some(v) => v,
            None => {
                let v = self.with_slot(self.reviewer.review_access(user, &attrs)).await?;
                let ttl = match v {
                    AccessVerdict::Allowed => self.config.allowed_ttl,
                    AccessVerdict::Denied { .. } => self.config.denied_ttl,
                };
                self.access.insert(key, v.clone(), ttl, Instant::now());
                v
            }
        };
        match verdict {
            AccessVerdict::Allowed => Ok(attrs),
            AccessVerdict::Denied { reason } => Err(AuthError::Forbidden {
                user: user.username.clone(),
                verb: attrs.verb,
                subresource: attrs.subresource,
                reason,
            }),
        }
    }

    /// Runs one review within the in-flight cap and the timeout.
    async fn with_slot<T>(
        &self,
        review: impl std::future::Future<Output = Result<T, ReviewError>>,
    ) -> Result<T, AuthError> {
        let timeout = self.config.review_timeout;
        let started = tokio::time::Instant::now();
        let _slot = match tokio::time::timeout(timeout, self.reviews.acquire()).await {
            Ok(Ok(slot)) => slot,
            // The semaphore is never closed; treat it like a full one.
            Ok(Err(_)) | Err(_) => {
                return Err(AuthError::Busy { max: self.config.max_concurrent_reviews, waited: started.elapsed() })
            }
        };
        let left = timeout.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, review).await {
            Ok(r) => r.map_err(AuthError::Review),
            Err(_) => Err(AuthError::Review(ReviewError::Timeout { kind: "review", timeout })),
        }
    }
}

/// The access cache key: the whole identity and the attributes.
fn access_key(user: &UserInfo, attrs: &Attributes) -> cache::Key {
    let mut parts: Vec<&[u8]> =
        vec![user.username.as_bytes(), user.uid.as_bytes(), attrs.verb.as_bytes(), attrs.subresource.as_bytes()];
    let n_groups = user.groups.len().to_string();
    parts.push(n_groups.as_bytes());
    parts.extend(user.groups.iter().map(|g| g.as_bytes()));
    let n_extra = user.extra.len().to_string();
    parts.push(n_extra.as_bytes());
    let counts: Vec<String> = user.extra.values().map(|v| v.len().to_string()).collect();
    for ((k, values), count) in user.extra.iter().zip(&counts) {
        parts.push(k.as_bytes());
        parts.push(count.as_bytes());
        parts.extend(values.iter().map(|v| v.as_bytes()));
    }
    cache::key(parts)
}

/// The bearer token of an `Authorization` header: `None` without one, an error when it is
/// something else (`Basic …`, an empty token, not text).
fn bearer(authorization: Option<&HeaderValue>) -> Result<Option<&str>, AuthError> {
    let Some(value) = authorization else { return Ok(None) };
    let text = value.to_str().map_err(|_| AuthError::MalformedAuthorization)?.trim();
    let (scheme, token) = text.split_once(' ').ok_or(AuthError::MalformedAuthorization)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() || token.contains(' ') {
        return Err(AuthError::MalformedAuthorization);
    }
    Ok(Some(token))
}

/// The axum middleware in front of every kubelet route: authenticate, authorize, then run the
/// route; a refusal is answered here and logged once.
pub async fn guard(State(auth): State<Arc<KubeletAuth>>, request: Request, next: Next) -> Response {
    let peer = request.extensions().get::<httpd::Peer>().cloned();
    let certificates = peer.as_ref().map(|p| p.certificates.clone()).unwrap_or_else(|| Arc::from(Vec::new()));
    let addr = peer.map(|p| p.addr.to_string()).unwrap_or_default();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    // Owned before any await: a borrowed request would make this future !Send.
    let authorization = request.headers().get(header::AUTHORIZATION).cloned();
    let span =
        tracing::debug_span!("kubelet_request", %method, path = %path, peer = %addr, user = tracing::field::Empty);
    async move {
        let decided = async {
            let user = auth.authenticate(&certificates, authorization.as_ref()).await?;
            tracing::Span::current().record("user", user.username.as_str());
            auth.authorize(&user, &method, &path).await.map(|attrs| (user, attrs))
        }
        .await;
        match decided {
            Ok((user, attrs)) => {
                tracing::debug!(user = user.username, verb = attrs.verb, subresource = attrs.subresource, "allowed");
                next.run(request).await
            }
            Err(e) => {
                let chain = foundation::error_chain(&e);
                match e.status() {
                    StatusCode::SERVICE_UNAVAILABLE => tracing::warn!(error = chain, "kubelet request refused"),
                    status => tracing::debug!(%status, error = chain, "kubelet request refused"),
                }
                e.into_response()
            }
        }
    }
    .instrument(span)
    .await
}

#[cfg(test)]
pub(crate) mod testing {
    //! A fake [`Reviewer`]: tokens and grants set by the test, every call counted, failures and
    //! stalls on demand.
    use super::*;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Mutex;

    #[derive(Default)]
    pub struct FakeReviewer {
        /// token → user name (groups: `["g:" + name]`).
        pub tokens: Mutex<HashMap<String, String>>,
        /// (user, verb, subresource) allowed.
        pub grants: Mutex<Vec<(String, String, String)>>,
        pub token_calls: AtomicUsize,
        pub access_calls: AtomicUsize,
        /// Every call fails (the API server is away).
        pub down: AtomicBool,
        /// Every call hangs.
        pub stall: AtomicBool,
    }

    impl FakeReviewer {
        pub fn with_token(self, token: &str, user: &str) -> Self {
            self.tokens.lock().expect("lock").insert(token.into(), user.into());
            self
        }
        pub fn allow(self, user: &str, verb: &str, subresource: &str) -> Self {
            self.grants.lock().expect("lock").push((user.into(), verb.into(), subresource.into()));
            self
        }
        pub fn calls(&self) -> (usize, usize) {
            (self.token_calls.load(Ordering::SeqCst), self.access_calls.load(Ordering::SeqCst))
        }
        async fn gate(&self, kind: &'static str) -> Result<(), ReviewError> {
            if self.stall.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            if self.down.load(Ordering::SeqCst) {
                return Err(ReviewError::NoStatus { kind });
            }
            Ok(())
        }
    }

    #[async_trait::async_trait]
    impl Reviewer for FakeReviewer {
        async fn review_token(&self, token: &str) -> Result<TokenVerdict, ReviewError> {
            self.token_calls.fetch_add(1, Ordering::SeqCst);
            self.gate("TokenReview").await?;
            Ok(match self.tokens.lock().expect("lock").get(token) {
                Some(user) => TokenVerdict::Authenticated(UserInfo {
                    username: user.clone(),
                    groups: vec![format!("g:{user}")],
                    ..Default::default()
                }),
                None => TokenVerdict::Rejected,
            })
        }

        async fn review_access(&self, user: &UserInfo, attrs: &Attributes) -> Result<AccessVerdict, ReviewError> {
            self.access_calls.fetch_add(1, Ordering::SeqCst);
            self.gate("SubjectAccessReview").await?;
            let wanted = (user.username.clone(), attrs.verb.to_string(), attrs.subresource.to_string());
            Ok(if self.grants.lock().expect("lock").contains(&wanted) {
                AccessVerdict::Allowed
            } else {
                AccessVerdict::Denied { reason: "no grant".into() }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::FakeReviewer;
    use super::x509::testing::{stranger, Ca};
    use super::*;
    use std::sync::atomic::Ordering;

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).expect("header")
    }

    fn auth(reviewer: Arc<FakeReviewer>, ca: Option<&Ca>, config: AuthConfig) -> KubeletAuth {
        let ca = ca.map(|c| ClientCa::new(std::slice::from_ref(&c.der)).expect("ca")).unwrap_or_else(ClientCa::none);
        KubeletAuth::new("vk-1", ca, reviewer, config)
    }

    #[tokio::test]
    async fn identities_come_from_the_ca_or_a_token_review() {
        let ca = Ca::new("kubernetes");
        let fake = Arc::new(FakeReviewer::default().with_token("good", "alice"));
        let a = auth(fake.clone(), Some(&ca), AuthConfig::default());
        let client = ca.client(Some("kube-apiserver-kubelet-client"), &["ops"]);

        let who = a.authenticate(std::slice::from_ref(&client.der), None).await.expect("cert");
        assert_eq!(who.username, "kube-apiserver-kubelet-client");
        assert_eq!(who.groups, ["ops"]);
        assert_eq!(fake.calls(), (0, 0), "a certificate needs no review");
        // A verified certificate wins over a token.
        let who = a.authenticate(&[client.der], Some(&hv("Bearer good"))).await.expect("cert");
        assert_eq!(who.username, "kube-apiserver-kubelet-client");

        let who = a.authenticate(&[], Some(&hv("Bearer good"))).await.expect("token");
        assert_eq!(who.username, "alice");
        let who = a.authenticate(&[], Some(&hv("bearer   good "))).await.expect("scheme is case-insensitive");
        assert_eq!(who.username, "alice");
        assert_eq!(fake.calls().0, 1, "the second use of a token is a cache hit");
        // An unknown certificate does not stop a good token (the union of authenticators).
        let who = a.authenticate(&[stranger("x").der], Some(&hv("Bearer good"))).await.expect("token");
        assert_eq!(who.username, "alice");

        let e = a.authenticate(&[], None).await.expect_err("anonymous");
        assert!(matches!(e, AuthError::Anonymous));
        let e = a.authenticate(&[stranger("system:admin").der], None).await.expect_err("stranger");
        assert!(matches!(e, AuthError::Certificate(CertError::Unverified(_))), "{e}");
        let e = a.authenticate(&[], Some(&hv("Bearer bad"))).await.expect_err("bad token");
        assert!(matches!(e, AuthError::TokenRejected));
        for header in ["Basic YTpi", "Bearer", "Bearer ", "Bearer a b", "good"] {
            let e = a.authenticate(&[], Some(&hv(header))).await.expect_err(header);
            assert!(matches!(e, AuthError::MalformedAuthorization), "{header}: {e}");
        }
        for e in [AuthError::Anonymous, AuthError::TokenRejected, AuthError::MalformedAuthorization] {
            assert_eq!(e.status(), StatusCode::UNAUTHORIZED);
        }
    }

    #[tokio::test]
    async fn the_token_cap_is_hit_before_any_review() {
        let fake = Arc::new(FakeReviewer::default());
        let a = auth(fake.clone(), None, AuthConfig { max_token_bytes: 64, ..AuthConfig::default() });
        let long = format!("Bearer {}", "x".repeat(65));
        let e = a.authenticate(&[], Some(&hv(&long))).await.expect_err("too long");
        assert!(matches!(e, AuthError::TokenTooLong { max: 64 }), "{e}");
        assert_eq!(e.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(fake.calls(), (0, 0));
        let at_cap = format!("Bearer {}", "x".repeat(64));
        assert!(matches!(a.authenticate(&[], Some(&hv(&at_cap))).await, Err(AuthError::TokenRejected)));
        assert_eq!(fake.calls(), (1, 0));
    }

    #[tokio::test]
    async fn every_request_is_authorized_and_the_answers_are_cached() {
        let fake = Arc::new(FakeReviewer::default().allow("alice", "get", "proxy"));
        let a = auth(fake.clone(), None, AuthConfig::default());
        let alice = UserInfo { username: "alice".into(), ..Default::default() };
        let attrs = a.authorize(&alice, &Method::GET, "/pods").await.expect("allowed");
        assert_eq!(attrs, Attributes { verb: "get", subresource: "proxy", node: "vk-1".into() });
        a.authorize(&alice, &Method::HEAD, "/healthz").await.expect("HEAD is get");
        assert_eq!(fake.calls().1, 1, "same user, verb and subresource: cached");
        let e = a.authorize(&alice, &Method::GET, "/stats/summary").await.expect_err("no stats grant");
        assert_eq!(e.to_string(), "Forbidden (user=alice, verb=get, resource=nodes, subresource=stats)");
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
        let e = a.authorize(&alice, &Method::POST, "/exec/ns/p/c").await.expect_err("no create grant");
        assert!(matches!(e, AuthError::Forbidden { verb: "create", subresource: "proxy", .. }), "{e}");
        a.authorize(&alice, &Method::GET, "/stats/summary").await.expect_err("denial cached");
        assert_eq!(fake.calls().1, 3);
        // Another identity with the same name but other groups is reviewed on its own.
        let other = UserInfo { username: "alice".into(), groups: vec!["x".into()], ..Default::default() };
        a.authorize(&other, &Method::GET, "/pods").await.expect("allowed by name");
        assert_eq!(fake.calls().1, 4);
        let e = a.authorize(&alice, &Method::OPTIONS, "/pods").await.expect_err("no verb");
        assert!(matches!(e, AuthError::NoVerb { .. }));
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
        assert_eq!(fake.calls().1, 4, "a method without a verb is refused without a review");
    }

    #[tokio::test]
    async fn review_failures_fail_closed_and_are_not_cached() {
        let fake = Arc::new(FakeReviewer::default().with_token("good", "alice").allow("alice", "get", "proxy"));
        let a = auth(fake.clone(), None, AuthConfig::default());
        fake.down.store(true, Ordering::SeqCst);
        let e = a.authenticate(&[], Some(&hv("Bearer good"))).await.expect_err("API server away");
        assert!(matches!(e, AuthError::Review(_)), "{e}");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        let alice = UserInfo { username: "alice".into(), ..Default::default() };
        let e = a.authorize(&alice, &Method::GET, "/pods").await.expect_err("API server away");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(a.cached(), (0, 0), "failures are not cached");
        fake.down.store(false, Ordering::SeqCst);
        a.authenticate(&[], Some(&hv("Bearer good"))).await.expect("back");
        a.authorize(&alice, &Method::GET, "/pods").await.expect("back");
    }

    #[tokio::test(start_paused = true)]
    async fn the_in_flight_cap_and_the_timeout_bound_stalled_reviews() {
        let fake = Arc::new(FakeReviewer::default());
        let config =
            AuthConfig { max_concurrent_reviews: 2, review_timeout: Duration::from_secs(10), ..AuthConfig::default() };
        let a = auth(fake.clone(), None, config);
        // Both slots taken (two reviews stuck elsewhere): the next request waits, then gets 503.
        let held = a.reviews.acquire_many(2).await.expect("slots");
        let started = tokio::time::Instant::now();
        let e = a.authenticate(&[], Some(&hv("Bearer t"))).await.expect_err("no slot");
        assert!(matches!(e, AuthError::Busy { max: 2, .. }), "{e}");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert_eq!(fake.calls(), (0, 0), "no review was started past the cap");
        drop(held);
        // A review that hangs is cut off at the timeout.
        fake.stall.store(true, Ordering::SeqCst);
        let started = tokio::time::Instant::now();
        let e = a.authenticate(&[], Some(&hv("Bearer t"))).await.expect_err("stalled");
        assert!(matches!(e, AuthError::Review(ReviewError::Timeout { .. })), "{e}");
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert_eq!(a.reviews.available_permits(), 2, "the slot is given back");
    }

    #[tokio::test]
    async fn the_caches_stay_within_their_cap_under_a_token_flood() {
        let fake = Arc::new(FakeReviewer::default());
        let a = auth(fake.clone(), None, AuthConfig { cache_entries: 50, ..AuthConfig::default() });
        for n in 0..500 {
            let _ = a.authenticate(&[], Some(&hv(&format!("Bearer random-{n}")))).await;
        }
        assert_eq!(a.cached().0, 50);
        assert_eq!(fake.calls().0, 500);
    }
}
