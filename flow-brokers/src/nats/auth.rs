//! How the NATS source authenticates and secures its connection. Secrets never sit in the spec:
//! user and password or a token come from environment variables, an nkey seed or a `.creds` file
//! from a file; all are read once when the spec is validated, so a missing one is a violation with
//! its path rather than a failure at the first connect.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::ConnectOptions;
use flow_core::{SpecPaths, Violation};
use serde::{Deserialize, Serialize};

use super::error::NatsSourceError;

/// One way to authenticate (`auth:` in the source's parameters), written as a map with exactly
/// one of the keys below (serde_yaml 0.9 reads enums only from `!tag` values, which a spec
/// author should not need to know).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", try_from = "AuthForms", into = "AuthForms")]
pub enum NatsAuth {
    /// `{user_password: {user: NAME, password_env_var: VAR}}`
    UserPassword {
        /// The NATS user name.
        user: String,
        /// The environment variable holding the password.
        password_env_var: String,
    },
    /// `{token: {env_var: VAR}}`
    Token {
        /// The environment variable holding the token.
        env_var: String,
    },
    /// `{nkey_seed_file: PATH}`: a file holding the user's nkey seed (`SU...`).
    NkeySeedFile(PathBuf),
    /// `{credentials_file: PATH}`: a `.creds` file (JWT and nkey seed).
    CredentialsFile(PathBuf),
}

/// The `auth:` map as written: every form optional, exactly one required. `NatsAuth` is
/// serialized through it too, so that a config made in code reads back as the spec form.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthForms {
    #[serde(skip_serializing_if = "Option::is_none")]
    user_password: Option<UserPassword>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token: Option<TokenAuth>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nkey_seed_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    credentials_file: Option<PathBuf>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct UserPassword {
    user: String,
    password_env_var: String,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenAuth {
    env_var: String,
}

impl NatsAuth {
    /// The file it names, as the spec means it ([`SpecPaths::resolve`]).
    pub(crate) fn resolve_paths(&mut self, paths: SpecPaths<'_>) {
        match self {
            NatsAuth::NkeySeedFile(path) | NatsAuth::CredentialsFile(path) => {
                *path = paths.resolve(path);
            }
            NatsAuth::UserPassword { .. } | NatsAuth::Token { .. } => {}
        }
    }
}

impl From<NatsAuth> for AuthForms {
    fn from(auth: NatsAuth) -> AuthForms {
        let mut forms = AuthForms {
            user_password: None,
            token: None,
            nkey_seed_file: None,
            credentials_file: None,
        };
        match auth {
            NatsAuth::UserPassword {
                user,
                password_env_var,
            } => {
                forms.user_password = Some(UserPassword {
                    user,
                    password_env_var,
                })
            }
            NatsAuth::Token { env_var } => forms.token = Some(TokenAuth { env_var }),
            NatsAuth::NkeySeedFile(path) => forms.nkey_seed_file = Some(path),
            NatsAuth::CredentialsFile(path) => forms.credentials_file = Some(path),
        }
        forms
    }
}

impl TryFrom<AuthForms> for NatsAuth {
    type Error = String;

    fn try_from(forms: AuthForms) -> Result<NatsAuth, String> {
        let mut chosen = Vec::new();
        if let Some(UserPassword {
            user,
            password_env_var,
        }) = forms.user_password
        {
            chosen.push(NatsAuth::UserPassword {
                user,
                password_env_var,
            });
        }
        if let Some(TokenAuth { env_var }) = forms.token {
            chosen.push(NatsAuth::Token { env_var });
        }
        if let Some(path) = forms.nkey_seed_file {
            chosen.push(NatsAuth::NkeySeedFile(path));
        }
        if let Some(path) = forms.credentials_file {
            chosen.push(NatsAuth::CredentialsFile(path));
        }
        match chosen.len() {
            1 => Ok(chosen.remove(0)),
            0 => Err(
                "give one of `user_password`, `token`, `nkey_seed_file`, `credentials_file`"
                    .to_owned(),
            ),
            _ => Err(
                "give only one of `user_password`, `token`, `nkey_seed_file`, `credentials_file`"
                    .to_owned(),
            ),
        }
    }
}

/// The resolved secrets and TLS settings; builds fresh [`ConnectOptions`] for each connect.
#[derive(Clone)]
pub(crate) struct ConnectSettings {
    secret: Option<Secret>,
    tls_ca_files: Vec<PathBuf>,
}

#[derive(Clone)]
enum Secret {
    UserPassword(String, String),
    Token(String),
    NkeySeed(String),
    CredentialsFile(PathBuf),
}

/// Resolves `auth` and checks `tls_ca_files`; every problem is a violation with its path.
pub(crate) fn connect_options(
    auth: Option<&NatsAuth>,
    tls_ca_files: &[PathBuf],
) -> Result<ConnectSettings, Vec<Violation>> {
    let mut violations = Vec::new();
    let secret = auth.and_then(|auth| resolve(auth).map_err(|v| violations.push(v)).ok());
    for (i, path) in tls_ca_files.iter().enumerate() {
        if !path.is_file() {
            violations.push(Violation::new(
                format!("parameters.tls_ca_files[{i}]"),
                format!("`{}` is not a readable file", path.display()),
            ));
        }
    }
    if violations.is_empty() {
        Ok(ConnectSettings {
            secret,
            tls_ca_files: tls_ca_files.to_vec(),
        })
    } else {
        Err(violations)
    }
}

fn env_secret(var: &str, path: &str) -> Result<String, Violation> {
    match std::env::var(var) {
        Ok(value) if !value.is_empty() => Ok(value),
        _ => Err(Violation::new(
            path,
            format!("environment variable `{var}` is not set (or empty); export it before starting the worker"),
        )),
    }
}

fn resolve(auth: &NatsAuth) -> Result<Secret, Violation> {
    match auth {
        NatsAuth::UserPassword {
            user,
            password_env_var,
        } => Ok(Secret::UserPassword(
            user.clone(),
            env_secret(
                password_env_var,
                "parameters.auth.user_password.password_env_var",
            )?,
        )),
        NatsAuth::Token { env_var } => Ok(Secret::Token(env_secret(
            env_var,
            "parameters.auth.token.env_var",
        )?)),
        NatsAuth::NkeySeedFile(path) => std::fs::read_to_string(path)
            .map(|seed| Secret::NkeySeed(seed.trim().to_owned()))
            .map_err(|err| {
                Violation::new(
                    "parameters.auth.nkey_seed_file",
                    format!("cannot read `{}`: {err}", path.display()),
                )
            }),
        NatsAuth::CredentialsFile(path) if path.is_file() => {
            Ok(Secret::CredentialsFile(path.clone()))
        }
        NatsAuth::CredentialsFile(path) => Err(Violation::new(
            "parameters.auth.credentials_file",
            format!("`{}` is not a readable file", path.display()),
        )),
    }
}

impl ConnectSettings {
    pub(crate) async fn options(&self) -> Result<ConnectOptions, NatsSourceError> {
        let mut options = ConnectOptions::new()
            .name("flow-worker")
            .retry_on_initial_connect()
            .connection_timeout(Duration::from_secs(5))
            .request_timeout(Some(Duration::from_secs(10)));
        options = match &self.secret {
            None => options,
            Some(Secret::UserPassword(user, password)) => {
                options.user_and_password(user.clone(), password.clone())
            }
            Some(Secret::Token(token)) => options.token(token.clone()),
            Some(Secret::NkeySeed(seed)) => options.nkey(seed.clone()),
            Some(Secret::CredentialsFile(path)) => {
                options.credentials_file(path).await.map_err(|source| {
                    NatsSourceError::Credentials {
                        path: path.clone(),
                        source,
                    }
                })?
            }
        };
        for path in &self.tls_ca_files {
            options = options
                .add_root_certificates(path.clone())
                .require_tls(true);
        }
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_password_variable_is_a_violation_with_its_path() {
        let auth = NatsAuth::UserPassword {
            user: "flow".into(),
            password_env_var: "FLOW_TEST_SURELY_UNSET_NATS_PASSWORD".into(),
        };
        let violations = connect_options(Some(&auth), &[]).err().unwrap_or_default();
        assert_eq!(violations.len(), 1);
        assert_eq!(
            violations[0].path,
            "parameters.auth.user_password.password_env_var"
        );
        assert!(violations[0]
            .message
            .contains("FLOW_TEST_SURELY_UNSET_NATS_PASSWORD"));
    }

    #[test]
    fn a_missing_ca_file_is_a_violation_with_its_index() {
        let files = [PathBuf::from("/nonexistent/ca.pem")];
        let violations = connect_options(None, &files).err().unwrap_or_default();
        assert_eq!(violations.len(), 1);
        assert_eq!(violations[0].path, "parameters.tls_ca_files[0]");
    }

    #[test]
    fn auth_forms_parse_from_a_spec_map_and_exactly_one_is_required(
    ) -> Result<(), serde_yaml::Error> {
        // Specs reach the source as a `serde_yaml::Value`.
        let value: serde_yaml::Value = serde_yaml::from_str("token: {env_var: NATS_TOKEN}")?;
        let auth: NatsAuth = serde_yaml::from_value(value)?;
        assert_eq!(
            auth,
            NatsAuth::Token {
                env_var: "NATS_TOKEN".into()
            }
        );
        let auth: NatsAuth = serde_yaml::from_str("credentials_file: /etc/flow/user.creds")?;
        assert_eq!(
            auth,
            NatsAuth::CredentialsFile("/etc/flow/user.creds".into())
        );
        let auth: NatsAuth =
            serde_yaml::from_str("user_password: {user: flow, password_env_var: NATS_PASSWORD}")?;
        assert_eq!(
            auth,
            NatsAuth::UserPassword {
                user: "flow".into(),
                password_env_var: "NATS_PASSWORD".into()
            }
        );
        let two = serde_yaml::from_str::<NatsAuth>("token: {env_var: T}\nnkey_seed_file: /s")
            .map_err(|e| e.to_string());
        assert!(
            two.as_ref().is_err_and(|e| e.contains("give only one of")),
            "{two:?}"
        );
        let typo =
            serde_yaml::from_str::<NatsAuth>("tokn: {env_var: T}").map_err(|e| e.to_string());
        assert!(
            typo.as_ref()
                .is_err_and(|e| e.contains("unknown field `tokn`")),
            "{typo:?}"
        );
        Ok(())
    }
}
