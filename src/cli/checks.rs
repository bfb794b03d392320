//! What is allowed but unsafe in how the agent reaches its brokers and its secrets (issue
//! 27): `validate` prints these warnings, `run` logs them at start. They come beside
//! [`crate::config::Config::warnings`] (a password file others can read), from the parsed
//! config and the files it names, as the user the command runs as: after
//! [`super::owner::become_data_dir_owner`] that is the owner of the data directory, the user
//! the service runs as.
//!
//! - A connection without a username: with an anonymous broker, any local user can connect
//!   under the agent's client ID, take over its session and receive the inputs queued in it,
//!   and publish fake inputs or fake results (the shipped `config/mosquitto.conf` refuses
//!   anonymous clients).
//! - A password sent in clear: a username without `tls` to a broker that is not on this box.
//! - A TLS key its group or everyone can read.
//! - A file the connection needs (password, CA, certificate, key) that this user cannot
//!   read: the agent would start and then fail at every connection attempt.

use std::net::IpAddr;
use std::path::Path;

use crate::config::{Config, MqttConfig};
use crate::text::Shown;

/// One line per problem, each naming the key and what to do.
pub(crate) fn security_warnings(cfg: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let links = [("mqtt", &cfg.mqtt)]
        .into_iter()
        .chain(cfg.uplink.as_ref().map(|u| ("uplink", &u.mqtt)));
    for (section, m) in links {
        link_warnings(section, m, &mut out);
    }
    out
}

/// Whether `host` is this box: a loopback address or `localhost`.
fn is_local(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn link_warnings(section: &str, m: &MqttConfig, out: &mut Vec<String>) {
    let host = Shown(&m.host);
    match (&m.username, &m.tls) {
        (None, _) => out.push(format!(
            "{section}: connects anonymously (no username): on a broker that lets anonymous \
             clients in, any local user can connect under client_id `{}`, take over the \
             agent's session and the inputs queued in it, and publish fake inputs or results; \
             give the agent a user of its own (config/mosquitto.conf and mosquitto.acl; \
             docs/operations.md, \"Before the box goes into service\")",
            Shown(&m.client_id)
        )),
        (Some(_), None) if !is_local(&m.host) => out.push(format!(
            "{section}: the password goes to {host} in clear (no tls): anyone on the way can \
             read it and log in as the agent; add `tls = {{ ca_file = \"...\" }}` and the \
             broker's TLS listener"
        )),
        _ => {}
    }
    let mut files: Vec<(String, &Path)> = Vec::new();
    if let Some(p) = &m.password_file {
        files.push((format!("{section}.password_file"), p));
    }
    if let Some(t) = &m.tls {
        files.push((format!("{section}.tls.ca_file"), &t.ca_file));
        if let Some(c) = &t.cert_file {
            files.push((format!("{section}.tls.cert_file"), c));
        }
        if let Some(k) = &t.key_file {
            let key = format!("{section}.tls.key_file");
            if let Some(w) = readable_by_others(&key, k) {
                out.push(w);
            }
            files.push((key, k));
        }
    }
    for (key, path) in files {
        if let Err(e) = std::fs::File::open(path) {
            out.push(format!(
                "{key}: {} cannot be read by {}: {e}; the agent, running as that user, could \
                 not connect (make it readable by that user only)",
                Shown(&path.display().to_string()),
                super::owner::current_user()
            ));
        }
    }
}

/// The warning for a private key its group or everyone may read.
fn readable_by_others(key: &str, path: &Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o7777;
    let who = match (mode & 0o040 != 0, mode & 0o004 != 0) {
        (_, true) => "everyone",
        (true, false) => "its group",
        (false, false) => return None,
    };
    let shown = Shown(&path.display().to_string()).to_string();
    Some(format!(
        "{key}: {shown} is readable by {who} (mode {mode:04o}): it is the agent's private \
         key, and whoever reads it can pose as the agent; `chmod 600 {shown}` (or 640 with \
         only the service's group)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn cfg(mqtt: &str) -> Config {
        crate::config::parse_str(
            &format!(
                "[mqtt]\nclient_id = \"box-1\"\n{mqtt}\n[storage]\ndata_dir = \".\"\n\
                 [[pipeline]]\nname = \"p\"\ntopics = [\"a/#\"]\nevent_id = \"/id\"\n\
                 key = \"/k\"\naggregate = \"count\"\noutput_topic = \"o/{{key}}\"\n"
            ),
            Path::new("t.toml"),
        )
        .unwrap()
    }

    #[test]
    fn each_unsafe_link_gets_one_warning_and_a_safe_one_none() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, mode: u32| {
            let p = dir.path().join(name);
            std::fs::write(&p, "x").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p.display().to_string()
        };
        let (pw, ca, key) = (file("pw", 0o600), file("ca", 0o644), file("key", 0o644));
        let warnings = |mqtt: &str| security_warnings(&cfg(mqtt));

        let w = warnings("");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("mqtt: connects anonymously"), "{w:?}");
        assert!(w[0].contains("client_id `box-1`"), "{w:?}");

        let login = format!("username = \"u\"\npassword_file = \"{pw}\"\n");
        assert!(warnings(&login).is_empty(), "{:?}", warnings(&login));
        for local in ["localhost", "127.0.0.2", "::1"] {
            let w = warnings(&format!("host = \"{local}\"\n{login}"));
            assert!(w.is_empty(), "{local}: {w:?}");
        }
        let w = warnings(&format!("host = \"broker.example\"\n{login}"));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("the password goes to broker.example in clear"),
            "{w:?}"
        );

        let tls = format!(
            "host = \"broker.example\"\n{login}tls = {{ ca_file = \"{ca}\", cert_file = \"{ca}\", \
             key_file = \"{key}\" }}\n"
        );
        let w = warnings(&tls);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("mqtt.tls.key_file: "), "{w:?}");
        assert!(w[0].contains("readable by everyone (mode 0644)"), "{w:?}");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(warnings(&tls)[0].contains("readable by its group"));
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(warnings(&tls).is_empty(), "{:?}", warnings(&tls));

        let missing = dir.path().join("missing").display().to_string();
        let w = warnings(&format!(
            "username = \"u\"\npassword_file = \"{missing}\"\n"
        ));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("mqtt.password_file: ") && w[0].contains("cannot be read by"),
            "{w:?}"
        );
    }
}
