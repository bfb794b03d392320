//! `cairn validate`'s summary of a validated config: every key of the table of keys
//! ([`crate::config::keys`]) with the value it takes, as TOML, section by section and one
//! `[[pipeline]]` table per pipeline. A value the default gave is marked `# default`; a key
//! left unset is a comment. A new key shows up here by being in the table.

use super::*;
use crate::config::keys::{Get, KEYS, section_of};

/// The summary `cairn validate` prints.
pub fn summary(cfg: &Config) -> String {
    let mut out = String::new();
    let mut section = "";
    for k in KEYS {
        let Get::Config(get) = k.get else { continue };
        let s = section_of(k.name);
        if s != section {
            section = s;
            if !out.is_empty() {
                out.push('\n');
            }
            if s == "uplink" && cfg.uplink.is_none() {
                out.push_str("# [uplink] not set: results go to [mqtt]'s broker\n");
            } else {
                out.push_str(&format!("[{s}]\n"));
            }
        }
        if s == "uplink" && cfg.uplink.is_none() {
            continue;
        }
        let mut line = line(&k.name[s.len() + 1..], get(cfg), &k.default_text());
        if k.name == "mqtt.client_id" && cfg.mqtt.client_id.len() > PORTABLE_CLIENT_ID_LEN {
            line.push_str(&format!(
                "  # {} characters: MQTT 3.1.1 only guarantees {PORTABLE_CLIENT_ID_LEN}",
                cfg.mqtt.client_id.len()
            ));
        }
        out.push_str(&line);
    }
    for sink in &cfg.sinks {
        out.push_str("\n[[sink]]\n");
        for k in KEYS {
            if let Get::Sink(get) = k.get {
                let short = &k.name["sink.".len()..];
                // Keys of another kind are not this sink's at all.
                if let Some(v) = get(sink) {
                    out.push_str(&line(short, Some(v), &k.default_text()));
                } else if sink_kind_has(sink, short) {
                    out.push_str(&line(short, None, &k.default_text()));
                }
            }
        }
    }
    for p in &cfg.pipelines {
        out.push_str("\n[[pipeline]]\n");
        for k in KEYS {
            if let Get::Pipeline(get) = k.get {
                let short = &k.name["pipeline.".len()..];
                out.push_str(&line(short, get(p), &k.default_text()));
            }
        }
    }
    out
}

/// Whether `key` (below `sink.`) is a key of `sink`'s kind, set or not.
fn sink_kind_has(sink: &crate::config::SinkConfig, key: &str) -> bool {
    match sink.kind {
        crate::config::SinkKind::Mqtt(_) => {
            ["username", "password_file"].contains(&key) || key.starts_with("tls.")
        }
        crate::config::SinkKind::Postgres(_) => {
            ["url", "password_file", "source", "table_prefix"].contains(&key)
                || key.starts_with("tls.")
        }
        crate::config::SinkKind::JetStream(_) => {
            [
                "servers",
                "credentials_file",
                "username",
                "password_file",
                "token_file",
                "stream",
                "subject_prefix",
                "source",
            ]
            .contains(&key)
                || key.starts_with("tls.")
        }
    }
}

/// `key = value`, marked when it is the default, or a comment when unset.
fn line(key: &str, value: Option<String>, default: &str) -> String {
    match value {
        Some(v) if v == default => format!("{key} = {v}  # default\n"),
        Some(v) => format!("{key} = {v}\n"),
        None => format!("# {key}: not set\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_lists_every_key_of_the_table_and_reads_back_as_the_same_config() {
        let text = "[mqtt]\nclient_id = \"a-client-id-longer-than-23\"\nport = 1884\n\
                    [storage]\ndata_dir = \"/d\"\n\
                    [[sink]]\nname = \"central\"\nkind = \"mqtt\"\nclient_id = \"c\"\n\
                    [[sink]]\nname = \"db\"\nkind = \"postgres\"\nurl = \"postgresql://c@db/t\"\n\
                    source = \"box-1\"\n\
                    [[sink]]\nname = \"js\"\nkind = \"jetstream\"\nservers = [\"nats://n:4222\"]\n\
                    stream = \"R\"\nsource = \"box-1\"\ncredentials_file = \"/c\"\n\
                    [[pipeline]]\nname = \"p\"\ntopics = [\"t/#\"]\nevent_id = \"{/d}-{/s}\"\n\
                    key = \"/k\"\nvalue = \"/v\"\naggregate = [\"min\", \"p95\"]\n\
                    where = '/v > 2 and (/k == \"a\" or not /x < 1.5)'\n\
                    window = { size = \"1m\", slide = \"30s\" }\n\
                    output_topic = \"o/{key}/{window_start}\"\n";
        let cfg = parse_str(text, Path::new("t.toml")).unwrap();
        let s = summary(&cfg);
        assert!(s.contains("port = 1884\n"), "{s}");
        assert!(s.contains("host = \"127.0.0.1\"  # default\n"), "{s}");
        assert!(s.contains("MQTT 3.1.1 only guarantees 23"), "{s}");
        assert!(s.contains("# username: not set\n"), "{s}");
        assert!(s.contains("# [uplink] not set"), "{s}");
        for k in KEYS {
            let short = &k.name[section_of(k.name).len() + 1..];
            if !k.name.starts_with("uplink.") {
                assert!(
                    s.contains(&format!("{short} =")) || s.contains(&format!("# {short}:")),
                    "{}",
                    k.name
                );
            }
        }
        // What it lists, with the comments gone, is the same config again.
        let listed: String = s
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| format!("{}\n", l.split("  #").next().unwrap()))
            .collect();
        let back = parse_str(&listed, Path::new("summary.toml"))
            .unwrap_or_else(|e| panic!("{e}\n{listed}"));
        assert_eq!(
            Config {
                source: cfg.source.clone(),
                ..back
            },
            cfg
        );
    }
}
