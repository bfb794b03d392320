//! The NATS JetStream sink (`kind = "jetstream"`): each result is one message on
//! `<subject_prefix>.<topic as tokens>` (escaping in `subject.rs`), its data the MQTT result's
//! JSON, its `Nats-Msg-Id` header `<source>/<id>`.
//!
//! **Guarantee.** The stream stores each result once as long as a re-send comes within the
//! stream's duplicate window (`duplicate_window`, 2 minutes by default): the stream drops a
//! repeated `Nats-Msg-Id` and acks it as a duplicate, which settles it. A re-send after an
//! outage longer than the window is stored again; the journal says so
//! (`jetstream_outage_outlasted_duplicate_window`), and consumers keep the highest
//! (generation, version) per key.
//!
//! **Mechanism.** The stream must exist and one of its subjects must cover
//! `<subject_prefix>.>`; otherwise the sink refuses, naming the stream's subjects. A result is
//! settled only on the stream's ack (a publish acknowledged by the server alone is not
//! stored). Subjects longer than [`MAX_SUBJECT`] and messages over the server's
//! `max_payload` or the stream's `max_msg_size` are dead letters before they are sent (the
//! server would close the connection over the first, refuse the others forever).

use std::future::IntoFuture;
use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::context::{GetStreamErrorKind, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;

use super::subject::{covers, subject};
use super::{Destination, SinkError, SinkEvent, SinkResult, Verdict};
use crate::config::TlsConfig;

/// `[[sink]] kind = "jetstream"`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct JetStreamConfig {
    pub name: String,
    pub servers: Vec<String>,
    pub credentials_file: Option<PathBuf>,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
    pub tls: Option<TlsConfig>,
    pub stream: String,
    pub subject_prefix: String,
    pub source: String,
}

/// The longest subject sent. A NATS server reads a publish's control line (`HPUB <subject>
/// <reply> <sizes>`) into at most `max_control_line` bytes, 4096 by default, and closes the
/// connection of a client that sends more; the reply inbox and sizes take about 100.
pub const MAX_SUBJECT: usize = 3900;

/// What JetStream says when a message is over the stream's `max_msg_size`.
const MESSAGE_TOO_LARGE: u64 = 10054;
/// What JetStream says when the stream is not there.
const STREAM_NOT_FOUND: u64 = 10059;

/// How long to wait for the stream's answers.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);

pub struct JetStream {
    cfg: JetStreamConfig,
    client: Option<async_nats::Client>,
    js: Option<jetstream::Context>,
    window: Option<Duration>,
    /// The smaller of the server's `max_payload` and the stream's `max_msg_size`.
    max_message: usize,
    warned: bool,
}

impl JetStreamConfig {
    /// What is wrong with the keys, as (key, problem), for config validation.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if self.servers.is_empty() {
            out.push(("servers", "name at least one server".to_string()));
        }
        for s in &self.servers {
            if s.parse::<async_nats::ServerAddr>().is_err() {
                out.push((
                    "servers",
                    format!("`{}` is not a NATS server URL", s.escape_debug()),
                ));
            }
        }
        let ways = [
            self.credentials_file.is_some(),
            self.username.is_some(),
            self.token_file.is_some(),
        ];
        if ways.iter().filter(|w| **w).count() > 1 {
            out.push((
                "credentials_file",
                "give one of credentials_file, username (with password_file), token_file".into(),
            ));
        }
        if self.password_file.is_some() && self.username.is_none() {
            out.push(("password_file", "goes with username".into()));
        }
        if self.stream.is_empty()
            || self.stream.len() > 255
            || self.stream.contains(['.', '*', '>', '/', '\\'])
            || self.stream.contains(char::is_whitespace)
        {
            out.push((
                "stream",
                format!(
                    "`{}` is not a stream name (no `.`, `*`, `>`, `/`, `\\` or white space)",
                    self.stream.escape_debug()
                ),
            ));
        }
        if let Err(e) = check_prefix(&self.subject_prefix) {
            out.push(("subject_prefix", e));
        }
        if let Err(e) = super::check_source(&self.source) {
            out.push(("source", e));
        }
        out
    }
}

fn check_prefix(prefix: &str) -> Result<(), String> {
    if prefix.is_empty()
        || !prefix
            .split('.')
            .any(|t| t.is_empty() || t.contains(['*', '>']) || t.contains(char::is_whitespace))
    {
        Ok(())
    } else {
        Err(format!(
            "`{}` is no subject: tokens separated by `.`, none empty, no `*`, `>` or white space",
            prefix.escape_debug()
        ))
    }
}

impl JetStream {
    pub fn new(cfg: JetStreamConfig) -> Result<JetStream, String> {
        if cfg.servers.is_empty() {
            return Err("servers: name at least one".into());
        }
        if cfg
            .subject_prefix
            .split('.')
            .any(|t| t.is_empty() || t.contains(['*', '>']) || t.contains(char::is_whitespace))
            && !cfg.subject_prefix.is_empty()
        {
            return Err(format!(
                "subject_prefix `{}` is no subject: tokens separated by `.`, none empty, \
                 no `*`, `>` or white space",
                cfg.subject_prefix
            ));
        }
        Ok(JetStream {
            cfg,
            client: None,
            js: None,
            window: None,
            max_message: usize::MAX,
            warned: false,
        })
    }

    async fn open(&self) -> Result<async_nats::Client, SinkError> {
        let refused = SinkError::Refused;
        let mut opts = async_nats::ConnectOptions::new();
        if let Some(path) = &self.cfg.credentials_file {
            opts = opts
                .credentials_file(path)
                .await
                .map_err(|e| refused(format!("credentials_file {}: {e}", path.display())))?;
        }
        if let Some(user) = &self.cfg.username {
            let pass = match &self.cfg.password_file {
                Some(p) => super::read_secret("password_file", p).map_err(refused)?,
                None => String::new(),
            };
            opts = opts.user_and_password(user.clone(), pass);
        }
        if let Some(path) = &self.cfg.token_file {
            opts = opts.token(super::read_secret("token_file", path).map_err(refused)?);
        }
        if let Some(tls) = &self.cfg.tls {
            let config = super::tls_client_config(tls).map_err(refused)?;
            opts = opts.require_tls(true).tls_client_config(config);
        }
        opts.connection_timeout(Duration::from_secs(5))
            .connect(self.cfg.servers.as_slice())
            .await
            .map_err(|e| {
                use async_nats::ConnectErrorKind as K;
                match e.kind() {
                    K::AuthorizationViolation | K::Authentication | K::Tls | K::ServerParse => {
                        refused(format!("connect: {e}"))
                    }
                    _ => SinkError::Down(format!("connect: {e}")),
                }
            })
    }
}

impl Destination for JetStream {
    async fn connect(&mut self) -> Result<String, SinkError> {
        // The client reconnects by itself; a new one only if there is none yet.
        let client = match &self.client {
            Some(c) => c.clone(),
            None => {
                let c = self.open().await?;
                self.client = Some(c.clone());
                c
            }
        };
        let js = jetstream::ContextBuilder::new()
            .timeout(ACK_TIMEOUT)
            .build(client.clone());
        let mut stream = js
            .get_stream(&self.cfg.stream)
            .await
            .map_err(|e| match e.kind() {
                GetStreamErrorKind::JetStream(j) if j.error_code().0 == STREAM_NOT_FOUND => {
                    SinkError::Refused(format!(
                        "stream `{}` does not exist: create it (Cairn does not) with a subject \
                     covering `{}.>`",
                        self.cfg.stream, self.cfg.subject_prefix
                    ))
                }
                GetStreamErrorKind::JetStream(j) => {
                    SinkError::Refused(format!("stream `{}`: {j}", self.cfg.stream))
                }
                _ => SinkError::Down(format!("stream `{}`: {e}", self.cfg.stream)),
            })?;
        let info = stream
            .info()
            .await
            .map_err(|e| SinkError::Down(format!("stream info: {e}")))?;
        let config = &info.config;
        if !config
            .subjects
            .iter()
            .any(|s| covers(s, &self.cfg.subject_prefix))
        {
            return Err(SinkError::Refused(format!(
                "stream `{}` has subjects {:?}, none covering `{}.>`: add one",
                self.cfg.stream, config.subjects, self.cfg.subject_prefix
            )));
        }
        let window = config.duplicate_window;
        let server_max = client.server_info().max_payload;
        let stream_max = usize::try_from(config.max_message_size)
            .ok()
            .filter(|&m| m > 0)
            .unwrap_or(usize::MAX);
        self.max_message = server_max.min(stream_max);
        self.window = Some(window);
        self.warned = false;
        let replicas = config.num_replicas.max(1);
        self.js = Some(js);
        Ok(format!(
            "stream {} (R{replicas}), duplicate window {}",
            self.cfg.stream,
            super::human(window)
        ))
    }

    async fn deliver(
        &mut self,
        batch: &[SinkResult],
        _position: u64,
    ) -> Result<Vec<Verdict>, SinkError> {
        let Some(js) = &self.js else {
            return Err(SinkError::Down("not connected".into()));
        };
        let mut verdicts = vec![Verdict::Retry; batch.len()];
        let mut waiting = Vec::with_capacity(batch.len());
        for (i, r) in batch.iter().enumerate() {
            let subj = subject(&self.cfg.subject_prefix, &r.topic);
            let msg_id = format!("{}/{}", self.cfg.source, r.id);
            if subj.len() > MAX_SUBJECT {
                verdicts[i] = Verdict::DeadLetter {
                    reason: "jetstream_subject_too_long",
                    detail: format!("subject of {} bytes, over {MAX_SUBJECT}", subj.len()),
                };
                continue;
            }
            // The headers travel in the message: `NATS/1.0\r\nNats-Msg-Id: ..\r\n\r\n`.
            let size = r.payload.len() + msg_id.len() + 32;
            if size > self.max_message {
                verdicts[i] = Verdict::DeadLetter {
                    reason: "jetstream_too_large",
                    detail: format!("message of {size} bytes, over {}", self.max_message),
                };
                continue;
            }
            let publish = PublishMessage::build()
                .payload(r.payload.clone().into())
                .message_id(msg_id);
            match js.send_publish(subj, publish).await {
                Ok(ack) => waiting.push((i, ack)),
                // Not sent: the client's queue is full or it is closed.
                Err(_) => break,
            }
        }
        let mut down = None;
        let mut acked = 0usize;
        // One deadline for the batch: each ack's own timeout starts only when it is awaited,
        // so awaiting 100 of them in turn against a dead server would take 100 timeouts.
        let deadline = tokio::time::Instant::now() + ACK_TIMEOUT;
        for (i, ack) in waiting {
            let Ok(answer) = tokio::time::timeout_at(deadline, ack.into_future()).await else {
                down.get_or_insert("no ack within 5 s".to_string());
                continue;
            };
            match answer {
                Ok(_) => {
                    // Stored now or before (a duplicate): either way the stream holds it.
                    verdicts[i] = Verdict::Settled;
                    acked += 1;
                }
                Err(e) => {
                    let code = std::error::Error::source(&e)
                        .and_then(|s| s.downcast_ref::<jetstream::Error>())
                        .map(|j| j.error_code().0);
                    if e.kind() == PublishErrorKind::Other && code == Some(MESSAGE_TOO_LARGE) {
                        verdicts[i] = Verdict::DeadLetter {
                            reason: "jetstream_too_large",
                            detail: e.to_string(),
                        };
                    } else {
                        down.get_or_insert(e.to_string());
                    }
                }
            }
        }
        match down {
            Some(reason) if acked == 0 => Err(SinkError::Down(format!("no ack: {reason}"))),
            _ => Ok(verdicts),
        }
    }

    fn duplicate_window(&self) -> Option<Duration> {
        self.window
    }

    fn down_for(&mut self, down: Duration) -> Option<SinkEvent> {
        let window = self.window?;
        if self.warned || down <= window {
            return None;
        }
        self.warned = true;
        Some(SinkEvent::Warning {
            name: "jetstream_outage_outlasted_duplicate_window",
            message: format!(
                "stream {} has been unreachable for {}, longer than its duplicate window of {}: \
                 a result re-sent now may be stored twice (consumers keep the highest \
                 (generation, version) per key)",
                self.cfg.stream,
                super::human(down),
                super::human(window)
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_problems_name_their_key() {
        let good = JetStreamConfig {
            name: "stream".into(),
            servers: vec!["nats://n1.example:4222".into(), "n2.example:4222".into()],
            stream: "RESULTS".into(),
            subject_prefix: "site.box-17".into(),
            source: "box-17".into(),
            ..Default::default()
        };
        assert!(good.problems().is_empty(), "{:?}", good.problems());
        let bad = JetStreamConfig {
            servers: vec![],
            username: Some("u".into()),
            token_file: Some("/t".into()),
            stream: "A.B".into(),
            subject_prefix: "site..x".into(),
            source: "".into(),
            ..good.clone()
        };
        let keys: Vec<&str> = bad.problems().iter().map(|p| p.0).collect();
        assert_eq!(
            keys,
            [
                "servers",
                "credentials_file",
                "stream",
                "subject_prefix",
                "source"
            ]
        );
        let alone = JetStreamConfig {
            password_file: Some("/p".into()),
            ..good
        };
        assert_eq!(alone.problems()[0].0, "password_file");
    }
}
