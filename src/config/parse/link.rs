//! The connection keys `[mqtt]`, `[uplink]` and `[[sink]]` of kind mqtt share (host, port,
//! client ID, keep-alive, credentials, TLS, reconnect backoff), taken out of each one's raw
//! table by [`raw_link!`] and checked by one code under that section's name.
//!
//! The raw tables still declare these keys each (`raw.rs`). `serde(flatten)` would share
//! the declaration, but serde then reads the table through a buffer of its own: tried with
//! serde 1.0.229 and toml_edit 0.22.27, an unknown key came out as "unknown field `x`"
//! without the list of known keys, and it and a wrong type in a shared key both carried the
//! whole table's span, not the key's, so the problem would name `[uplink]` and its header
//! line, and the whole table would be dropped to look for more problems.

use super::*;

/// The connection keys `[mqtt]`, `[uplink]` and `[[sink]]` share, as read.
pub(super) struct RawLink {
    pub(super) host: Option<String>,
    pub(super) port: Option<i64>,
    pub(super) client_id: Option<String>,
    pub(super) keep_alive: Option<DurationText>,
    pub(super) username: Option<String>,
    pub(super) password_file: Option<String>,
    pub(super) tls: Option<RawTls>,
    pub(super) reconnect_min: Option<DurationText>,
    pub(super) reconnect_max: Option<DurationText>,
}

/// Moves the connection keys out of a raw table that declares them under these names
/// (`RawMqtt`, `RawUplink`, `RawSink`); its other keys stay usable.
macro_rules! raw_link {
    ($r:ident) => {
        RawLink {
            host: $r.host,
            port: $r.port,
            client_id: $r.client_id,
            keep_alive: $r.keep_alive,
            username: $r.username,
            password_file: $r.password_file,
            tls: $r.tls,
            reconnect_min: $r.reconnect_min,
            reconnect_max: $r.reconnect_max,
        }
    };
}
pub(super) use raw_link;

impl Validator {
    /// The connection keys `[mqtt]`, `[uplink]` and `[[sink]]` share, under `section`; `ingest_batch`
    /// and `channel_capacity` are left 0 for the caller.
    pub(super) fn link(&mut self, section: &str, r: RawLink) -> Option<MqttConfig> {
        let host_key = format!("{section}.host");
        let default_host = match keys::row(&host_key).default {
            Def::Text(h) => h,
            _ => "",
        };
        let host = r.host.unwrap_or_else(|| default_host.to_string());
        let host_ok = self.require(
            &host_key,
            !host.is_empty() && !host.contains(char::is_whitespace),
            || format!("`{host}` is not a host name or IP address"),
        );
        let port = self
            .int(&format!("{section}.port"), r.port)
            .map(|p| p as u16);

        let client_id = self.client_id(section, r.client_id);

        let keep_alive = self.keep_alive(section, r.keep_alive);

        let username = match r.username {
            Some(u) if u.is_empty() => {
                self.problem(
                    &format!("{section}.username"),
                    "is empty: remove it, or name the user",
                );
                None
            }
            u => Some(u),
        };
        let password_file = self.path(&format!("{section}.password_file"), r.password_file);
        if let (Some(Some(_)), Some(None)) = (&password_file, &username) {
            self.problem(
                &format!("{section}.password_file"),
                format!(
                    "needs `{section}.username`: MQTT 3.1.1 does not allow a password without a \
                     user name"
                ),
            );
        }
        let tls = match r.tls {
            None => Some(None),
            Some(t) => self.tls(section, t).map(Some),
        };

        let (reconnect_min, reconnect_max) =
            self.reconnect(section, r.reconnect_min, r.reconnect_max);

        Some(MqttConfig {
            host: host_ok.then_some(host)?,
            port: port?,
            client_id: client_id?,
            keep_alive: Duration::from_millis(keep_alive?),
            username: username?,
            password_file: password_file?,
            tls: tls?,
            ingest_batch: 0,
            reconnect_min: Duration::from_millis(reconnect_min?),
            reconnect_max: Duration::from_millis(reconnect_max?),
            channel_capacity: 0,
            will: None,
        })
    }
}
