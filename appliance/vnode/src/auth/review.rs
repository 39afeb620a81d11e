//! Asking the API server: `TokenReview` (authentication.k8s.io/v1) for bearer tokens and
//! `SubjectAccessReview` (authorization.k8s.io/v1) for every request, as the kubelet's webhook
//! authenticator and authorizer do. [`Reviewer`] is the seam: [`KubeReviewer`] calls the API
//! server with the node's own client; unit tests use a fake.
//!
//! The node identity needs `create` on `tokenreviews` and `subjectaccessreviews`; the Node
//! authorizer grants both to every node, and the providers' manifests bind
//! `system:auth-delegator` to each node for clusters without it.

use super::attributes::Attributes;
use super::UserInfo;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::PostParams;
use kube::Api;
use std::time::Duration;

/// What a `TokenReview` said about a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenVerdict {
    Authenticated(UserInfo),
    /// Not a token the API server knows (or one it says is invalid).
    Rejected,
}

/// What a `SubjectAccessReview` said about a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessVerdict {
    Allowed,
    /// Denied, or no authorizer had an opinion; the reason the API server gave, if any.
    Denied {
        reason: String,
    },
}

/// A review call that did not produce a verdict (the API server unreachable, refusing the node
/// or answering nonsense). Never cached; the request fails closed.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("the {kind} call failed")]
    Api {
        kind: &'static str,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("the {kind} call did not answer within {timeout:?}")]
    Timeout { kind: &'static str, timeout: Duration },
    #[error("the {kind} answer has no status")]
    NoStatus { kind: &'static str },
    #[error("the TokenReview authenticated a token but named no user")]
    NoUser,
}

/// Asks the API server about tokens and requests.
#[async_trait::async_trait]
pub trait Reviewer: Send + Sync {
    /// Who holds `token`.
    async fn review_token(&self, token: &str) -> Result<TokenVerdict, ReviewError>;
    /// Whether `user` may do `attrs`.
    async fn review_access(&self, user: &UserInfo, attrs: &Attributes) -> Result<AccessVerdict, ReviewError>;
}

/// [`Reviewer`] over the node's API client.
pub struct KubeReviewer {
    client: kube::Client,
    timeout: Duration,
}

impl KubeReviewer {
    /// Reviews through `client`, each call bounded by `timeout`.
    pub fn new(client: kube::Client, timeout: Duration) -> KubeReviewer {
        KubeReviewer { client, timeout }
    }

    async fn create<K>(&self, kind: &'static str, object: &K) -> Result<K, ReviewError>
    where
        K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope>
            + Clone
            + serde::Serialize
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
        K::DynamicType: Default,
    {
        let api: Api<K> = Api::all(self.client.clone());
        match tokio::time::timeout(self.timeout, api.create(&PostParams::default(), object)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(ReviewError::Api { kind, source: Box::new(e) }),
            Err(_) => Err(ReviewError::Timeout { kind, timeout: self.timeout }),
        }
    }
}

/// The verdict of a `TokenReview` answer.
pub fn token_verdict(answer: TokenReview) -> Result<TokenVerdict, ReviewError> {
    let status = answer.status.ok_or(ReviewError::NoStatus { kind: "TokenReview" })?;
    if status.authenticated != Some(true) {
        return Ok(TokenVerdict::Rejected);
    }
    let user = status.user.ok_or(ReviewError::NoUser)?;
    let username = user.username.filter(|u| !u.is_empty()).ok_or(ReviewError::NoUser)?;
    Ok(TokenVerdict::Authenticated(UserInfo {
        username,
        uid: user.uid.unwrap_or_default(),
        groups: user.groups.unwrap_or_default(),
        extra: user.extra.unwrap_or_default(),
    }))
}

/// The `SubjectAccessReview` the kubelet sends for `user` doing `attrs`.
pub fn access_review(user: &UserInfo, attrs: &Attributes) -> SubjectAccessReview {
    SubjectAccessReview {
        metadata: Default::default(),
        spec: SubjectAccessReviewSpec {
            user: Some(user.username.clone()),
            uid: Some(user.uid.clone()).filter(|u| !u.is_empty()),
            groups: Some(user.groups.clone()),
            extra: Some(user.extra.clone()).filter(|e| !e.is_empty()),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(attrs.verb.into()),
                group: Some(String::new()),
                version: Some(Attributes::VERSION.into()),
                resource: Some(Attributes::RESOURCE.into()),
                subresource: Some(attrs.subresource.into()),
                name: Some(attrs.node.clone()),
                namespace: Some(String::new()),
                ..Default::default()
            }),
            non_resource_attributes: None,
        },
        status: None,
    }
}

/// The verdict of a `SubjectAccessReview` answer.
pub fn access_verdict(answer: SubjectAccessReview) -> Result<AccessVerdict, ReviewError> {
    let status = answer.status.ok_or(ReviewError::NoStatus { kind: "SubjectAccessReview" })?;
    if status.allowed && status.denied != Some(true) {
        return Ok(AccessVerdict::Allowed);
    }
    let mut reason = status.reason.unwrap_or_default();
    if let Some(e) = status.evaluation_error.filter(|e| !e.is_empty()) {
        reason = if reason.is_empty() { e } else { format!("{reason}; {e}") };
    }
    Ok(AccessVerdict::Denied { reason })
}

#[async_trait::async_trait]
impl Reviewer for KubeReviewer {
    async fn review_token(&self, token: &str) -> Result<TokenVerdict, ReviewError> {
        let review = TokenReview {
            metadata: Default::default(),
            spec: TokenReviewSpec { token: token.to_owned(), audiences: None },
            status: None,
        };
        token_verdict(self.create("TokenReview", &review).await?)
    }

    async fn review_access(&self, user: &UserInfo, attrs: &Attributes) -> Result<AccessVerdict, ReviewError> {
        access_verdict(self.create("SubjectAccessReview", &access_review(user, attrs)).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::{TokenReviewStatus, UserInfo as ApiUser};
    use k8s_openapi::api::authorization::v1::SubjectAccessReviewStatus;

    #[test]
    fn the_review_has_the_kubelets_attributes() {
        let user = UserInfo {
            username: "system:serviceaccount:ns:sa".into(),
            uid: "u-1".into(),
            groups: vec!["system:serviceaccounts".into()],
            extra: [("k".to_string(), vec!["v".to_string()])].into(),
        };
        let attrs = Attributes { verb: "get", subresource: "stats", node: "vk-1".into() };
        let json = serde_json::to_value(access_review(&user, &attrs)).expect("json");
        assert_eq!(json["apiVersion"], "authorization.k8s.io/v1");
        assert_eq!(json["kind"], "SubjectAccessReview");
        let spec = &json["spec"];
        assert_eq!(spec["user"], "system:serviceaccount:ns:sa");
        assert_eq!(spec["uid"], "u-1");
        assert_eq!(spec["groups"][0], "system:serviceaccounts");
        assert_eq!(spec["extra"]["k"][0], "v");
        let ra = &spec["resourceAttributes"];
        assert_eq!(
            (&ra["verb"], &ra["resource"], &ra["subresource"], &ra["name"], &ra["version"], &ra["group"]),
            (&"get".into(), &"nodes".into(), &"stats".into(), &"vk-1".into(), &"v1".into(), &"".into())
        );
    }

    #[test]
    fn answers_become_verdicts() {
        let tr = |status: Option<TokenReviewStatus>| TokenReview { status, ..Default::default() };
        assert!(matches!(token_verdict(tr(None)), Err(ReviewError::NoStatus { .. })));
        assert_eq!(token_verdict(tr(Some(TokenReviewStatus::default()))).expect("ok"), TokenVerdict::Rejected);
        let no_user = TokenReviewStatus { authenticated: Some(true), ..Default::default() };
        assert!(matches!(token_verdict(tr(Some(no_user))), Err(ReviewError::NoUser)));
        let ok = TokenReviewStatus {
            authenticated: Some(true),
            user: Some(ApiUser {
                username: Some("alice".into()),
                groups: Some(vec!["g".into()]),
                ..Default::default()
            }),
            ..Default::default()
        };
        match token_verdict(tr(Some(ok))).expect("ok") {
            TokenVerdict::Authenticated(u) => assert_eq!((u.username.as_str(), u.groups.len()), ("alice", 1)),
            other => panic!("{other:?}"),
        }

        let sar = |status: Option<SubjectAccessReviewStatus>| SubjectAccessReview { status, ..Default::default() };
        assert!(matches!(access_verdict(sar(None)), Err(ReviewError::NoStatus { .. })));
        let allowed = SubjectAccessReviewStatus { allowed: true, ..Default::default() };
        assert_eq!(access_verdict(sar(Some(allowed))).expect("ok"), AccessVerdict::Allowed);
        let contradictory = SubjectAccessReviewStatus { allowed: true, denied: Some(true), ..Default::default() };
        assert!(matches!(access_verdict(sar(Some(contradictory))).expect("ok"), AccessVerdict::Denied { .. }));
        let denied = SubjectAccessReviewStatus {
            allowed: false,
            reason: Some("no RBAC".into()),
            evaluation_error: Some("webhook down".into()),
            ..Default::default()
        };
        assert_eq!(
            access_verdict(sar(Some(denied))).expect("ok"),
            AccessVerdict::Denied { reason: "no RBAC; webhook down".into() }
        );
    }
}
