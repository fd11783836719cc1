//! Permission violations reported by the NATS server.
//!
//! The server answers a publish or subscription that the user's permissions refuse with an
//! asynchronous `-ERR 'Permissions Violation for Publish to "<subject>"'`; the client only
//! hands it to the connection's event callback, and the refused request itself would just
//! time out. [`Denials`] carries those reports to the operations waiting on them, so that a
//! refused KV put, get or watch fails at once with [`crate::BusError::Denied`].

use tokio::sync::broadcast;

/// What the server refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenialKind {
    Publish,
    Subscribe,
}

impl DenialKind {
    /// `publish` or `subscribe`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Publish => "publish",
            Self::Subscribe => "subscribe",
        }
    }
}

/// One permissions violation reported by the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub kind: DenialKind,
    pub subject: String,
}

impl std::fmt::Display for Denial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "permissions violation for {} to {:?}",
            self.kind.as_str(),
            self.subject
        )
    }
}

impl Denial {
    /// Parses the server's error text, e.g. `Permissions Violation for Publish to "a.b"` or
    /// `Permissions Violation for Subscription to "a.b" using queue "q"`.
    pub fn parse(text: &str) -> Option<Self> {
        let lower = text.to_ascii_lowercase();
        let kind = if lower.starts_with("permissions violation for publish to ") {
            DenialKind::Publish
        } else if lower.starts_with("permissions violation for subscription to ") {
            DenialKind::Subscribe
        } else {
            return None;
        };
        let start = text.find('"')? + 1;
        let len = text[start..].find('"')?;
        Some(Self {
            kind,
            subject: text[start..start + len].to_string(),
        })
    }
}

/// The permission violations of one connection, as a broadcast. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Denials {
    tx: broadcast::Sender<Denial>,
}

impl Default for Denials {
    fn default() -> Self {
        Self::new()
    }
}

impl Denials {
    /// A channel no server error reaches until [`Denials::report`] is called.
    pub fn new() -> Self {
        let (tx, _) = broadcast::channel(256);
        Self { tx }
    }

    /// Hands one violation to everyone waiting.
    pub fn report(&self, denial: Denial) {
        let _ = self.tx.send(denial);
    }

    /// Violations reported from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Denial> {
        self.tx.subscribe()
    }

    /// Runs `fut`; if the server reports a violation whose subject satisfies `matches`
    /// before `fut` completes, returns that violation instead.
    pub async fn guard<T>(
        &self,
        matches: impl Fn(&Denial) -> bool,
        fut: impl std::future::Future<Output = T>,
    ) -> Result<T, Denial> {
        let mut rx = self.subscribe();
        tokio::pin!(fut);
        loop {
            tokio::select! {
                biased;
                out = &mut fut => return Ok(out),
                d = rx.recv() => match d {
                    Ok(d) if matches(&d) => return Err(d),
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return Ok(fut.await),
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_server_errors() {
        assert_eq!(
            Denial::parse(r#"Permissions Violation for Publish to "$KV.converge-plans.n2""#),
            Some(Denial {
                kind: DenialKind::Publish,
                subject: "$KV.converge-plans.n2".into()
            })
        );
        assert_eq!(
            Denial::parse(r#"Permissions Violation for Subscription to "x.y" using queue "q""#),
            Some(Denial {
                kind: DenialKind::Subscribe,
                subject: "x.y".into()
            })
        );
        assert_eq!(Denial::parse("Authorization Violation"), None);
    }

    #[tokio::test]
    async fn guard_returns_the_matching_denial() {
        let d = Denials::new();
        let d2 = d.clone();
        let slow = async {
            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            1
        };
        let reporter = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            d2.report(Denial {
                kind: DenialKind::Publish,
                subject: "other".into(),
            });
            d2.report(Denial {
                kind: DenialKind::Publish,
                subject: "a.b".into(),
            });
        });
        let r = d.guard(|x| x.subject == "a.b", slow).await;
        assert_eq!(r.unwrap_err().subject, "a.b");
        reporter.await.unwrap();
        assert_eq!(d.guard(|_| true, async { 7 }).await, Ok(7));
    }
}
