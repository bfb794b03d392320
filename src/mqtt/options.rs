//! [`MqttConfig`] → rumqttc `MqttOptions`: credentials from the password file, TLS from PEM
//! files (read with the PEM parser of `rustls::pki_types`). Every error names the file it
//! came from.

use std::path::Path;
use std::sync::Arc;

use rumqttc::{MqttOptions, TlsConfiguration, Transport};
// PEM through rustls's own `pki-types` (its `std` feature is on with rustls's): the
// `rustls-pemfile` crate is unmaintained (RUSTSEC-2025-0134) and only wraps this API now.
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::MqttError;
use crate::config::{MqttConfig, TlsConfig};

/// MQTT's own upper bound on a packet (remaining length of 268,435,455 bytes). rumqttc's
/// default is 10 KiB: a bigger incoming message would then fail the connection, the broker
/// would redeliver it on reconnect, and we would loop forever on one message. Size limits on
/// payloads are the agent's business (dead-letter, invariant 8), not a reason to disconnect.
const MQTT_MAX_PACKET: usize = 268_435_455;

pub(crate) fn build(cfg: &MqttConfig, publish_inflight: u16) -> Result<MqttOptions, MqttError> {
    check(cfg, publish_inflight)?;
    let mut opts = MqttOptions::new(cfg.client_id.clone(), cfg.host.clone(), cfg.port);
    opts.set_keep_alive(cfg.keep_alive)
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_inflight(rumqttc_inflight(publish_inflight))
        .set_max_packet_size(MQTT_MAX_PACKET, MQTT_MAX_PACKET);
    if let Some((user, password)) = credentials(cfg)? {
        opts.set_credentials(user, password);
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

/// What every connection's settings must be, whichever protocol.
fn check(cfg: &MqttConfig, publish_inflight: u16) -> Result<(), MqttError> {
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
    Ok(())
}

/// User name and password, the password read from its file. A password needs a user name
/// (MQTT 3.1.1 requires it; the same rule for MQTT 5 keeps one meaning for the settings).
fn credentials(cfg: &MqttConfig) -> Result<Option<(String, String)>, MqttError> {
    match (&cfg.username, &cfg.password_file) {
        (Some(user), Some(file)) => Ok(Some((user.clone(), read_password(file)?))),
        (Some(user), None) => Ok(Some((user.clone(), String::new()))),
        (None, Some(file)) => Err(MqttError::Config(format!(
            "password_file {} is set but username is not (MQTT 3.1.1 needs both)",
            file.display()
        ))),
        (None, None) => Ok(None),
    }
}

/// Most bytes of a packet the broker may send to an MQTT 5 result connection (CONNECT's
/// Maximum Packet Size): only acknowledgements and a DISCONNECT with its reason come.
const V5_MAX_INCOMING_PACKET: u32 = 64 * 1024;
/// The shortest keep-alive rumqttc's v5 client takes.
const V5_MIN_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(5);

/// The options of an MQTT 5 result connection (`super::v5`): the same checks, credentials
/// and TLS as [`build`], and no session (clean start: a publish-only connection keeps
/// nothing in one, and every unacknowledged publish is re-sent on the next connection).
/// rumqttc's window is exactly ours (it lowers it to the broker's Receive Maximum): this
/// connection sends no acknowledgements that a full window could hold back.
pub(crate) fn build_v5(
    cfg: &MqttConfig,
    publish_inflight: u16,
) -> Result<rumqttc::v5::MqttOptions, MqttError> {
    check(cfg, publish_inflight)?;
    // rumqttc's v5 client asserts (panics on) a shorter one, and has no "off": with 0 it
    // would ping without pause.
    if cfg.keep_alive < V5_MIN_KEEP_ALIVE {
        return Err(MqttError::Config(format!(
            "keep_alive must be at least {V5_MIN_KEEP_ALIVE:?} for an MQTT 5 connection, not \
             {:?}",
            cfg.keep_alive
        )));
    }
    let mut opts = rumqttc::v5::MqttOptions::new(cfg.client_id.clone(), cfg.host.clone(), cfg.port);
    opts.set_keep_alive(cfg.keep_alive)
        .set_clean_start(true)
        .set_manual_acks(false)
        .set_outgoing_inflight_upper_limit(publish_inflight)
        .set_max_packet_size(Some(V5_MAX_INCOMING_PACKET));
    if let Some((user, password)) = credentials(cfg)? {
        opts.set_credentials(user, password);
    }
    if let Some(tls) = &cfg.tls {
        opts.set_transport(Transport::tls_with_config(tls_config(tls)?));
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
/// holds at most that many and never reaches this one. A SUBSCRIBE takes a packet id from
/// the same sequence, so a window of publishes can still wrap onto an id in flight: rumqttc
/// then parks that publish (a "collision") and takes no more until its id is acknowledged,
/// which keeps the order. What it holds when a connection ends is sent again in our order,
/// not its own (`worker.rs`, `on_connack`).
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

/// The whole file, as bytes; an error names the file.
fn read_file(what: &'static str, path: &Path) -> Result<Vec<u8>, MqttError> {
    std::fs::read(path).map_err(|source| MqttError::File {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Every certificate in a PEM file, in order (other sections are skipped); at least one.
fn read_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, MqttError> {
    let pem = read_file(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_error(what, path, e))?;
    if certs.is_empty() {
        return Err(tls_error(what, path, "no PEM certificate found"));
    }
    Ok(certs)
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
    for cert in read_certs("CA", &tls.ca_file)? {
        roots
            .add(cert)
            .map_err(|e| tls_error("CA", &tls.ca_file, e))?;
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);

    let config = match (&tls.cert_file, &tls.key_file) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert_file), Some(key_file)) => {
            let certs = read_certs("client certificate", cert_file)?;
            // The first private key of any kind (PKCS#8, PKCS#1 or SEC1).
            let key = PrivateKeyDer::from_pem_slice(&read_file("client key", key_file)?).map_err(
                |e| match e {
                    pem::Error::NoItemsFound => {
                        tls_error("client key", key_file, "no PEM private key found")
                    }
                    e => tls_error("client key", key_file, e),
                },
            )?;
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

#[cfg(test)]
mod tests {
    use super::*;

    // A throwaway self-signed pair made for these tests only (openssl req -x509 -newkey ec).
    const CERT: &str = "-----BEGIN CERTIFICATE-----
MIIBjzCCATWgAwIBAgIUSUDb6Ew9as1fZhCEqJ7tXjkSlnIwCgYIKoZIzj0EAwIw
HDEaMBgGA1UEAwwRY2Fpcm4tdGVzdC1jbGllbnQwIBcNMjYxMjAxMjE0NDEzWhgP
MjEyNjExMDcyMTQ0MTNaMBwxGjAYBgNVBAMMEWNhaXJuLXRlc3QtY2xpZW50MFkw
EwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEfhHKY8JJTSEkblt/Q7w7hdjOYBGJAh0L
bAdHMKgUaex4pW79YwS0Htb9I74d50AbpCAzj1Q3ASCkqeq7RAmz+KNTMFEwHQYD
VR0OBBYEFLl53e0WaAgGXjotLR0fFFyY3GF0MB8GA1UdIwQYMBaAFLl53e0WaAgG
XjotLR0fFFyY3GF0MA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDSAAwRQIg
Zo4T9tC/vP/0L7nxNXaq7LXiKphheMvo0UGZPL0oXI8CIQDqdLa+Tdxg6St1unB1
9+Glm/Q4elLXmHIKcJ7ktU2wIw==
-----END CERTIFICATE-----
";
    const PKCS8_KEY: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgMCVelJjuIeG3TgUD
TVDPu8j7+LK+5RHPhltFWDrvKMahRANCAAR+EcpjwklNISRuW39DvDuF2M5gEYkC
HQtsB0cwqBRp7Hilbv1jBLQe1v0jvh3nQBukIDOPVDcBIKSp6rtECbP4
-----END PRIVATE KEY-----
";
    const SEC1_KEY: &str = "-----BEGIN EC PRIVATE KEY-----
MHcCAQEEIDAlXpSY7iHht04FA01Qz7vI+/iyvuURz4ZbRVg67yjGoAoGCCqGSM49
AwEHoUQDQgAEfhHKY8JJTSEkblt/Q7w7hdjOYBGJAh0LbAdHMKgUaex4pW79YwS0
Htb9I74d50AbpCAzj1Q3ASCkqeq7RAmz+A==
-----END EC PRIVATE KEY-----
";

    fn files(dir: &Path, ca: &str, cert: &str, key: &str) -> TlsConfig {
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        TlsConfig {
            ca_file: write("ca.pem", ca),
            cert_file: Some(write("cert.pem", cert)),
            key_file: Some(write("key.pem", key)),
        }
    }

    #[test]
    fn tls_reads_a_ca_a_client_certificate_and_a_pkcs8_or_sec1_key() {
        let dir = tempfile::tempdir().unwrap();
        for key in [PKCS8_KEY, SEC1_KEY] {
            // Other sections around the ones we want are skipped.
            let tls = files(
                dir.path(),
                &format!("{key}{CERT}"),
                CERT,
                &format!("{CERT}{key}"),
            );
            assert!(tls_config(&tls).is_ok());
        }
        let tls = TlsConfig {
            cert_file: None,
            key_file: None,
            ..files(dir.path(), CERT, CERT, PKCS8_KEY)
        };
        assert!(
            tls_config(&tls).is_ok(),
            "a CA alone: no client certificate"
        );
    }

    #[test]
    fn a_pem_file_without_what_it_should_hold_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let problem = |tls: &TlsConfig| match tls_config(tls) {
            Err(MqttError::Tls {
                what,
                path,
                problem,
            }) => {
                assert!(path.starts_with(dir.path()));
                format!("{what} {}: {problem}", path.file_name().unwrap().display())
            }
            Err(e) => panic!("not a TLS file error: {e}"),
            Ok(_) => panic!("accepted"),
        };
        let tls = files(dir.path(), PKCS8_KEY, CERT, PKCS8_KEY);
        assert_eq!(problem(&tls), "CA ca.pem: no PEM certificate found");
        let tls = files(dir.path(), CERT, PKCS8_KEY, PKCS8_KEY);
        assert_eq!(
            problem(&tls),
            "client certificate cert.pem: no PEM certificate found"
        );
        let tls = files(dir.path(), CERT, CERT, CERT);
        assert_eq!(
            problem(&tls),
            "client key key.pem: no PEM private key found"
        );
        // A section that never ends is malformed, not skipped.
        let torn = &CERT[..CERT.len() - 30];
        let tls = files(dir.path(), torn, CERT, PKCS8_KEY);
        assert!(
            problem(&tls).starts_with("CA ca.pem: "),
            "{}",
            problem(&tls)
        );
        let tls = TlsConfig {
            ca_file: dir.path().join("missing.pem"),
            ..tls
        };
        let Err(err) = tls_config(&tls) else {
            panic!("a missing file was accepted")
        };
        assert!(matches!(&err, MqttError::File { what: "CA", .. }), "{err}");
    }
}
