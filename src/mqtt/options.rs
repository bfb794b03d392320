//! [`MqttConfig`] → rumqttc `MqttOptions`: credentials from the password file, TLS from PEM
//! files. Every error names the file it came from.

use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use rumqttc::{MqttOptions, TlsConfiguration, Transport};

use super::MqttError;
use crate::config::{MqttConfig, TlsConfig};

/// MQTT's own upper bound on a packet (remaining length of 268,435,455 bytes). rumqttc's
/// default is 10 KiB: a bigger incoming message would then fail the connection, the broker
/// would redeliver it on reconnect, and we would loop forever on one message. Size limits on
/// payloads are the agent's business (dead-letter, invariant 8), not a reason to disconnect.
const MQTT_MAX_PACKET: usize = 268_435_455;

pub(crate) fn build(cfg: &MqttConfig, publish_inflight: u16) -> Result<MqttOptions, MqttError> {
    if cfg.client_id.is_empty() {
        return Err(MqttError::Config(
            "client_id must not be empty: the broker keeps the persistent session under it".into(),
        ));
    }
    if publish_inflight == 0 {
        return Err(MqttError::Config(
            "publish inflight must be at least 1".into(),
        ));
    }
    let keep_alive = cfg.keep_alive;
    if !keep_alive.is_zero() && keep_alive.as_secs() == 0 {
        return Err(MqttError::Config(format!(
            "keep_alive must be 0 (off) or at least 1s, not {keep_alive:?}"
        )));
    }
    let mut opts = MqttOptions::new(cfg.client_id.clone(), cfg.host.clone(), cfg.port);
    opts.set_keep_alive(keep_alive)
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_inflight(rumqttc_inflight(publish_inflight))
        .set_max_packet_size(MQTT_MAX_PACKET, MQTT_MAX_PACKET);

    match (&cfg.username, &cfg.password_file) {
        (Some(user), Some(file)) => {
            opts.set_credentials(user.clone(), read_password(file)?);
        }
        (Some(user), None) => {
            opts.set_credentials(user.clone(), "");
        }
        (None, Some(file)) => {
            return Err(MqttError::Config(format!(
                "password_file {} is set but username is not (MQTT 3.1.1 needs both)",
                file.display()
            )));
        }
        (None, None) => {}
    }

    if let Some(tls) = &cfg.tls {
        opts.set_transport(Transport::tls_with_config(tls_config(tls)?));
    }
    // A Sparkplug Primary Host's death certificate (issue 31, `agent/host.rs`).
    if let Some(will) = &cfg.will {
        let w = rumqttc::LastWill::new(
            will.topic.clone(),
            will.payload.clone(),
            rumqttc::QoS::AtLeastOnce,
            true,
        );
        opts.set_last_will(w);
    }
    Ok(opts)
}

/// rumqttc's own outgoing window: one more than ours, so that it is never full.
///
/// rumqttc 0.25.1 (`EventLoop::select`) stops reading its request channel altogether, acks
/// included, while `inflight >= max_inflight`. With a window equal to ours, a full window of
/// our publishes stopped our PUBACKs too: a broker sending a backlog without waiting for them
/// then piled them up here and in the agent, and pings could go unsent. [`super::Mqtt::publish`]
/// refuses at `publish_inflight` unacknowledged publishes (queued ones included), so rumqttc
/// holds at most that many and never reaches this one. With the broker acking in order (MQTT
/// 3.1.1 §4.6), a packet id is also never reused while still in flight: no collisions.
pub(crate) fn rumqttc_inflight(publish_inflight: u16) -> u16 {
    publish_inflight.saturating_add(1)
}

/// The whole file, minus one trailing newline (`\n` or `\r\n`) as editors and `echo` add.
fn read_password(path: &Path) -> Result<String, MqttError> {
    let text = std::fs::read_to_string(path).map_err(|source| MqttError::File {
        what: "password",
        path: path.to_owned(),
        source,
    })?;
    let text = text.strip_suffix('\n').unwrap_or(&text);
    let text = text.strip_suffix('\r').unwrap_or(text);
    Ok(text.to_owned())
}

fn open(what: &'static str, path: &Path) -> Result<BufReader<std::fs::File>, MqttError> {
    std::fs::File::open(path)
        .map(BufReader::new)
        .map_err(|source| MqttError::File {
            what,
            path: path.to_owned(),
            source,
        })
}

fn tls_error(what: &'static str, path: &Path, problem: impl ToString) -> MqttError {
    MqttError::Tls {
        what,
        path: path.to_owned(),
        problem: problem.to_string(),
    }
}

fn tls_config(tls: &TlsConfig) -> Result<TlsConfiguration, MqttError> {
    // Ignore the error: it only says a provider is already installed (by us or the binary).
    let _ = rustls::crypto::ring::default_provider().install_default();

    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut open("CA", &tls.ca_file)?) {
        let cert = cert.map_err(|e| tls_error("CA", &tls.ca_file, e))?;
        roots
            .add(cert)
            .map_err(|e| tls_error("CA", &tls.ca_file, e))?;
    }
    if roots.is_empty() {
        return Err(tls_error("CA", &tls.ca_file, "no PEM certificate found"));
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);

    let config = match (&tls.cert_file, &tls.key_file) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert_file), Some(key_file)) => {
            let certs = rustls_pemfile::certs(&mut open("client certificate", cert_file)?)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tls_error("client certificate", cert_file, e))?;
            if certs.is_empty() {
                return Err(tls_error(
                    "client certificate",
                    cert_file,
                    "no PEM certificate found",
                ));
            }
            let key = rustls_pemfile::private_key(&mut open("client key", key_file)?)
                .map_err(|e| tls_error("client key", key_file, e))?
                .ok_or_else(|| tls_error("client key", key_file, "no PEM private key found"))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| tls_error("client key", key_file, e))?
        }
        (Some(_), None) | (None, Some(_)) => {
            return Err(MqttError::Config(
                "tls.cert_file and tls.key_file go together: set both or neither".into(),
            ));
        }
    };
    Ok(TlsConfiguration::Rustls(Arc::new(config)))
}
