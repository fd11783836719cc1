//! Identifiers of jobs and hosts. Both become NATS subject tokens and KV keys, so they are
//! restricted to `[A-Za-z0-9_-]`, 1 to 64 characters, starting with a letter or digit.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Longest id accepted, in characters.
pub const MAX_ID_LEN: usize = 64;

/// Why an id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("id is empty")]
    Empty,
    #[error("id is {0} characters long; at most {MAX_ID_LEN} are allowed")]
    TooLong(usize),
    #[error("id must start with a letter or digit, not {0:?}")]
    BadStart(char),
    #[error(
        "id contains {0:?}; only ASCII letters, digits, '_' and '-' are allowed (ids become NATS subject tokens)"
    )]
    BadChar(char),
}

/// Checks that `s` is a valid job or host id.
pub fn validate_id(s: &str) -> Result<(), IdError> {
    let first = s.chars().next().ok_or(IdError::Empty)?;
    if s.len() > MAX_ID_LEN {
        return Err(IdError::TooLong(s.len()));
    }
    if !first.is_ascii_alphanumeric() {
        return Err(IdError::BadStart(first));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(IdError::BadChar(c));
    }
    Ok(())
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Validates and wraps `s`.
            pub fn new(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                validate_id(&s)?;
                Ok(Self(s))
            }
            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::new(s)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::new(s).map_err(serde::de::Error::custom)
            }
        }
    };
}

id_type!(
    /// A job's id, chosen by the user at submission (`id` in the job spec).
    JobId
);
id_type!(
    /// A host's id (by default its hostname), chosen by the agent's operator.
    HostId
);
id_type!(
    /// A queue's name (`converge queue create NAME`, `queue = "NAME"` in a job spec).
    QueueId
);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(input: &str, expect: Result<(), IdError>) {
        assert_eq!(validate_id(input), expect, "input {input:?}");
    }

    #[test]
    fn accepts_and_rejects() {
        check("mnist-mlp_1", Ok(()));
        check("A", Ok(()));
        check("", Err(IdError::Empty));
        check("-x", Err(IdError::BadStart('-')));
        check("a.b", Err(IdError::BadChar('.')));
        check("a*", Err(IdError::BadChar('*')));
        check("a>", Err(IdError::BadChar('>')));
        check("a b", Err(IdError::BadChar(' ')));
        check("é", Err(IdError::BadStart('é')));
        check(&"a".repeat(65), Err(IdError::TooLong(65)));
    }

    #[test]
    fn deserialize_validates() {
        assert!(serde_json::from_str::<JobId>("\"ok-1\"").is_ok());
        let err = serde_json::from_str::<JobId>("\"bad.id\"").unwrap_err();
        assert!(err.to_string().contains("'.'"), "{err}");
    }

    proptest! {
        #[test]
        fn valid_ids_are_single_subject_tokens(s in "[A-Za-z0-9][A-Za-z0-9_-]{0,63}") {
            prop_assert!(validate_id(&s).is_ok());
            let subject = crate::subjects::progress(
                &JobId::new(s.clone()).unwrap(),
                &HostId::new(s).unwrap(),
            );
            prop_assert_eq!(subject.split('.').count(), 5);
        }

        #[test]
        fn anything_with_a_dot_is_refused(a in "[a-z]{1,5}", b in "[a-z]{1,5}") {
            let joined = format!("{a}.{b}");
            prop_assert_eq!(validate_id(&joined), Err(IdError::BadChar('.')));
        }
    }
}
