//! `store.url`: which store it names, and how it is printed with its
//! password hidden.

/// A parsed `store.url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A `postgres://` or `postgresql://` URL, as given.
    Postgres(String),
    /// The SQLite database file.
    Sqlite(String),
}

impl StoreUrl {
    /// Recognises the two schemes; `sqlite://relative.db`, `sqlite:///abs.db`.
    pub fn parse(url: &str) -> Result<Self, String> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            crate::tls::install_crypto_provider();
            return crate::tls::postgres_config(url, None)
                .map(|_| StoreUrl::Postgres(url.to_owned()))
                .map_err(|error| {
                    // The URL is fine; the file it names is not.
                    if error.starts_with("sslrootcert: ") {
                        error
                    } else {
                        format!("not a valid PostgreSQL URL: {error}")
                    }
                });
        }
        match url.strip_prefix("sqlite://") {
            Some("") => Err("sqlite:// needs a file path, e.g. sqlite://dedupe.db".into()),
            Some(":memory:") => Err(
                "sqlite://:memory: would lose every key at exit; give a file path, e.g. sqlite://dedupe.db".into(),
            ),
            Some(path) if path.starts_with("file:") || path.contains('?') => Err(format!(
                "`{url}`: sqlite:// takes a plain file path (sqlite://relative.db or sqlite:///absolute.db), without a file: URI or ?query parameters"
            )),
            Some(path) => Ok(StoreUrl::Sqlite(path.to_owned())),
            None => Err(format!(
                "`{}` must start with sqlite://, postgres:// or postgresql://",
                Self::redact(url)
            )),
        }
    }

    /// For a `sqlite://` URL whose file does not exist, the file's full path:
    /// a relative path is read from the working directory, which is easy to
    /// get wrong when running a command by hand.
    pub fn missing_sqlite_file(url: &str) -> Option<std::path::PathBuf> {
        match Self::parse(url) {
            Ok(StoreUrl::Sqlite(path)) if !std::path::Path::new(&path).exists() => {
                std::path::absolute(&path).ok()
            }
            _ => None,
        }
    }

    /// The URL with any password replaced, for printing.
    pub fn redact(url: &str) -> String {
        let Some((scheme, rest)) = url.split_once("://") else {
            return redact_password_parameter(url.to_owned());
        };
        // tokio-postgres takes everything up to the first `@` as user and
        // password, `/` and `?` included (a generated password often holds
        // them unencoded); the credentials are cut at the last `@` before the
        // query instead, so a password holding `@` is hidden too.
        let redacted = match rest.find('@') {
            Some(first_at) => {
                let query = rest[first_at..]
                    .find('?')
                    .map_or(rest.len(), |q| first_at + q);
                let (userinfo, host_onwards) =
                    rest.split_at(rest[..query].rfind('@').unwrap_or(first_at));
                match userinfo.split_once(':') {
                    Some((user, _)) => format!("{scheme}://{user}:REDACTED{host_onwards}"),
                    None => url.to_owned(),
                }
            }
            None => url.to_owned(),
        };
        redact_password_parameter(redacted)
    }
}

/// libpq also takes the password as a query parameter, or as a field of a
/// `key=value` connection string (which `store.url` refuses, but names).
/// Every parameter named exactly `password` is redacted: a repeated one too
/// (the driver takes the last), and none merely ending in `password`.
fn redact_password_parameter(text: String) -> String {
    const KEY: &str = "password=";
    let mut redacted = String::with_capacity(text.len());
    let mut copied = 0;
    let mut from = 0;
    while let Some(found) = text[from..].find(KEY) {
        let start = from + found;
        let value_start = start + KEY.len();
        from = value_start;
        let is_key = text[..start]
            .chars()
            .next_back()
            .is_none_or(|before| matches!(before, '?' | '&') || before.is_whitespace());
        if !is_key {
            continue;
        }
        let value = &text[value_start..];
        let value_len = match value.strip_prefix('\'') {
            Some(quoted) => quoted.find('\'').map_or(value.len(), |end| end + 2),
            None => value
                .find(|c: char| c == '&' || c.is_whitespace())
                .unwrap_or(value.len()),
        };
        redacted.push_str(&text[copied..value_start]);
        redacted.push_str("REDACTED");
        copied = value_start + value_len;
        from = copied;
    }
    redacted.push_str(&text[copied..]);
    redacted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_urls_are_recognised() {
        assert_eq!(
            StoreUrl::parse("sqlite://dedupe.db"),
            Ok(StoreUrl::Sqlite("dedupe.db".into()))
        );
        assert_eq!(
            StoreUrl::parse("sqlite:///var/lib/d.db"),
            Ok(StoreUrl::Sqlite("/var/lib/d.db".into()))
        );
        assert!(matches!(
            StoreUrl::parse("postgres://u@localhost/db"),
            Ok(StoreUrl::Postgres(_))
        ));
        assert!(matches!(
            StoreUrl::parse("postgresql://u@localhost/db"),
            Ok(StoreUrl::Postgres(_))
        ));
        assert!(StoreUrl::parse("sqlite://").is_err());
        for not_a_file in [
            "sqlite://:memory:",
            "sqlite://file:keys.db",
            "sqlite://file::memory:?cache=shared",
            "sqlite://keys.db?mode=rwc",
        ] {
            assert!(StoreUrl::parse(not_a_file).is_err(), "{not_a_file}");
        }
        assert_eq!(
            StoreUrl::parse("sqlite:///var/lib/dedupe/keys.db"),
            Ok(StoreUrl::Sqlite("/var/lib/dedupe/keys.db".into()))
        );
        assert!(StoreUrl::parse("mysql://x").is_err());
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            StoreUrl::redact("postgres://u:secret@db:5432/x?sslmode=require"),
            "postgres://u:REDACTED@db:5432/x?sslmode=require"
        );
        assert_eq!(
            StoreUrl::redact("postgres://u@db/x?password=secret&sslmode=require"),
            "postgres://u@db/x?password=REDACTED&sslmode=require"
        );
        assert_eq!(StoreUrl::redact("sqlite://dedupe.db"), "sqlite://dedupe.db");
        assert_eq!(
            StoreUrl::redact("postgres://u@db/x?password=a&password=secret"),
            "postgres://u@db/x?password=REDACTED&password=REDACTED",
            "the driver takes the last"
        );
        assert_eq!(
            StoreUrl::redact("postgres://u@db/x?application_name=mypassword=x&password=secret"),
            "postgres://u@db/x?application_name=mypassword=x&password=REDACTED"
        );
    }

    #[test]
    fn a_key_value_connection_string_is_refused_without_showing_its_password() {
        for (given, shown) in [
            (
                "host=h user=u password=kvsecret dbname=d",
                "host=h user=u password=REDACTED dbname=d",
            ),
            (
                "host=h password='kv secret' dbname=d",
                "host=h password=REDACTED dbname=d",
            ),
        ] {
            let error = StoreUrl::parse(given).unwrap_err();
            assert!(!error.contains("secret"), "{error}");
            assert!(error.contains(shown), "{error}");
        }
    }

    #[test]
    fn passwords_holding_url_delimiters_are_redacted_whole() {
        for (url, redacted) in [
            ("postgres://u:ab/cd@db/x", "postgres://u:REDACTED@db/x"),
            ("postgres://u:ab?cd@db/x", "postgres://u:REDACTED@db/x"),
            ("postgres://u:a@b:c@db/x", "postgres://u:REDACTED@db/x"),
            (
                "postgres://u:a/b@db/x?application_name=a@b",
                "postgres://u:REDACTED@db/x?application_name=a@b",
            ),
            (
                "postgres://db/x?application_name=a@b",
                "postgres://db/x?application_name=a@b",
            ),
        ] {
            assert_eq!(StoreUrl::redact(url), redacted, "{url}");
        }
    }
}
