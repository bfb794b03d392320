//! `cairn validate`'s summary of a validated config: one line per concern, one per
//! pipeline.

use super::*;

/// A short human summary of a validated config, printed by `cairn validate`.
pub fn summary(cfg: &Config) -> String {
    let mut lines = broker_summary(&cfg.mqtt);
    if let Some(u) = &cfg.uplink {
        let m = &u.mqtt;
        lines.push(format!(
            "uplink      {}:{} as {} ({}, keep-alive {}), results to `{}<topic>`, reconnect {}..{}",
            m.host,
            m.port,
            m.client_id,
            if m.tls.is_some() { "TLS" } else { "plain TCP" },
            summary_duration(m.keep_alive),
            u.topic_prefix,
            summary_duration(m.reconnect_min),
            summary_duration(m.reconnect_max)
        ));
    }
    lines.extend(storage_summary(cfg));
    lines.extend(cfg.pipelines.iter().map(pipeline_summary));
    let mut out = String::new();
    for l in lines {
        out.push_str(&l);
        out.push('\n');
    }
    out
}

fn summary_duration(d: Duration) -> String {
    format_duration_ms(duration_ms(d))
}

/// The `broker` and `ingest` lines, with the client-ID portability note between them.
fn broker_summary(m: &MqttConfig) -> Vec<String> {
    let d = summary_duration;
    let cert = |t: &TlsConfig| {
        if t.cert_file.is_some() {
            " + client cert"
        } else {
            ""
        }
    };
    let auth = match (&m.username, &m.tls) {
        (None, None) => "no auth, plain TCP".to_string(),
        (Some(u), None) => format!("user {u}, plain TCP"),
        (None, Some(t)) => format!("TLS{}", cert(t)),
        (Some(u), Some(t)) => format!("user {u}, TLS{}", cert(t)),
    };
    let mut lines = vec![format!(
        "broker      {}:{} as {} ({auth}, keep-alive {})",
        m.host,
        m.port,
        m.client_id,
        d(m.keep_alive)
    )];
    if m.client_id.len() > PORTABLE_CLIENT_ID_LEN {
        lines.push(format!(
            "            note: client_id is {} chars; MQTT 3.1.1 only guarantees {PORTABLE_CLIENT_ID_LEN}",
            m.client_id.len()
        ));
    }
    lines.push(format!(
        "ingest      batch {}, channel {}, reconnect {}..{}",
        m.ingest_batch,
        m.channel_capacity,
        d(m.reconnect_min),
        d(m.reconnect_max)
    ));
    lines
}

/// The lines for storage, dead letters, the log, checkpoints, the outbox, metrics and
/// savepoints.
fn storage_summary(cfg: &Config) -> Vec<String> {
    let d = summary_duration;
    let l = &cfg.log;
    let o = &cfg.outbox;
    vec![
        format!(
            "data dir    {} (sled cache {}, ledger index <= {})",
            cfg.storage.data_dir.display(),
            format_size(cfg.storage.cache_size),
            format_size(cfg.storage.ledger_index_max)
        ),
        format!(
            "dead letters <= {}, <= {} old",
            cfg.dead_letters.max_entries,
            d(cfg.dead_letters.max_age)
        ),
        format!(
            "log         segments {}, max {}, retention {}, commit every {}, payload <= {}",
            format_size(l.segment_size),
            format_size(l.max_size),
            d(l.retention),
            d(l.commit_interval),
            format_size(l.max_payload)
        ),
        format!(
            "checkpoint  every {} or {} records or {} keys",
            d(cfg.checkpoint.interval),
            cfg.checkpoint.max_records,
            cfg.checkpoint.max_keys
        ),
        format!(
            "outbox      <= {} entries, <= {}, {} inflight, drain {}",
            o.max_entries,
            format_size(o.max_size),
            o.inflight,
            d(o.drain_timeout)
        ),
        format!(
            "metrics     {}",
            cfg.metrics.listen.as_deref().unwrap_or("off")
        ),
        match cfg.savepoint.interval {
            Some(i) => format!("savepoints  every {}, keep {}", d(i), cfg.savepoint.keep),
            None => "savepoints  off".to_string(),
        },
    ]
}

/// One `pipeline` line: topics, format, aggregate, window, output and limits.
fn pipeline_summary(p: &PipelineSpec) -> String {
    let format = match &p.format {
        Format::Json => "json".to_string(),
        Format::Delimited { separator } => format!("delimited {separator:?}"),
    };
    let value = p
        .value
        .as_ref()
        .map(|v| format!("({})", field_text(v)))
        .unwrap_or_default();
    let window = p
        .window
        .map(|w| {
            let slide = w
                .slide_ms
                .map(|s| format!(" sliding {}", format_duration_ms(s)))
                .unwrap_or_default();
            format!(
                " per {} window{slide} (lateness {})",
                format_duration_ms(w.size_ms),
                format_duration_ms(w.allowed_lateness_ms)
            )
        })
        .unwrap_or_default();
    format!(
        "pipeline    {}: {} [{format}] -> {}{value} by {}{window} -> {} ({}, {}, dedup {}, <= {} keys{})",
        p.name,
        p.topics.join(", "),
        aggregate_text(&p.aggregate),
        field_text(&p.key),
        p.output_topic,
        if p.retain { "retained" } else { "not retained" },
        match p.emit {
            Emit::Upsert => "upsert",
            Emit::Changelog => "changelog",
            Emit::Final => "final",
        },
        format_duration_ms(p.dedup_window_ms),
        p.max_keys,
        match p.start {
            crate::pipeline::spec::Start::Latest => "",
            crate::pipeline::spec::Start::Earliest =>
                ", start earliest: backfills the retained log",
        }
    )
}

/// A field as the config writes it.
fn field_text(f: &Field) -> String {
    match f {
        Field::Pointer(p) => p.clone(),
        Field::Index(i) => i.to_string(),
        Field::Topic(i) => format!("topic[{i}]"),
        Field::Template(parts) => parts
            .iter()
            .map(|part| match part {
                TemplatePart::Literal(l) => l.clone(),
                TemplatePart::Field(f) => format!("{{{}}}", field_text(f)),
            })
            .collect(),
    }
}
