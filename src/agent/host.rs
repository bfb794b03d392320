//! The Sparkplug host part (issue 31): Cairn as a Sparkplug B host application, over the
//! input connection.
//!
//! - **STATE** (with `[sparkplug] host_id`): the input connection registers a will of
//!   `spBv1.0/STATE/<host_id>` = `{"online":false,"timestamp":T}` (QoS 1, retained), `T`
//!   this run's start. After each connection it publishes `{"online":true,"timestamp":T}`
//!   the same way (spec 3.0: the birth carries the will's timestamp), only then: the
//!   connection is made after recovery, so the log is ready. Before a clean stop it
//!   publishes `{"online":false,...}` and waits for its PUBACK (the DISCONNECT that follows
//!   drops the will). Edge nodes that name this host as their Primary Host buffer while it
//!   says offline and send what they kept as historical values once it says online again.
//!   It subscribes to its own STATE (the spec asks it to), and answers an offline one that
//!   comes back while it runs by publishing online again.
//! - **Notices** from the live loop's processing (seq gaps, unknown metrics, DATA without a
//!   session): counted in `/metrics`, and in the journal at most once per node per
//!   [`REBIRTH_INTERVAL`]; with `rebirth = true` answered by an NCMD
//!   `Node Control/Rebirth`, at most one per node per [`REBIRTH_INTERVAL`]. Never for what
//!   the replay at start recomputes (the loop drops those).
//!
//! These are commands, not results: they go to the connection directly (QoS 1: the facade
//! publishes QoS 1 only, and the broker delivers at the node's subscription QoS), never
//! through the outbox, and a lost one is not sent again (the next notice asks again). Their
//! output IDs start with a control character, which no result ID has.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::config::{SparkplugConfig, Will};
use crate::metrics::SparkplugFigures;
use crate::mqtt::{Mqtt, MqttError};
use crate::pipeline::sparkplug::{self, Notice, NoticeKind};
use crate::text::Shown;

/// Shortest time between two rebirth requests to one edge node (and two journal lines
/// about it): a node answers with its BIRTHs within a second or two; asking again sooner
/// would only make it publish them again while they are on their way.
pub(crate) const REBIRTH_INTERVAL: Duration = Duration::from_secs(10);

/// Edge nodes remembered for the rate limit; past it, those asked longest ago are forgotten.
const ASKED_MAX: usize = 10_000;

/// Output IDs of our own publishes start with this (see the module docs).
const ID_PREFIX: &str = "\u{1}sparkplug/";

pub(crate) struct Host {
    /// With `host_id`: the STATE topic and this run's timestamp.
    state: Option<(String, u64)>,
    rebirth: bool,
    /// Online while running; offline once stopping.
    online_wanted: bool,
    /// A STATE publish waits for the connection (after each connect, or a change).
    state_due: bool,
    /// Our publishes awaiting their PUBACK: `Some(online)` for a STATE.
    inflight: HashMap<String, Option<bool>>,
    next_id: u64,
    connected: bool,
    /// When each edge node was last asked to rebirth (or last reported in the journal).
    asked: HashMap<(String, String), Instant>,
    pub(crate) figures: SparkplugFigures,
}

impl Host {
    pub(crate) fn new(cfg: &SparkplugConfig, wall_ms: u64) -> Host {
        Host {
            state: cfg
                .host_id
                .as_ref()
                .map(|id| (sparkplug::state_topic(id), wall_ms)),
            rebirth: cfg.rebirth,
            online_wanted: true,
            state_due: true,
            inflight: HashMap::new(),
            next_id: 0,
            connected: false,
            asked: HashMap::new(),
            figures: SparkplugFigures::default(),
        }
    }

    /// The will the input connection registers at connect, if Cairn is a Primary Host.
    pub(crate) fn will(&self) -> Option<Will> {
        self.state.as_ref().map(|(topic, stamp)| Will {
            topic: topic.clone(),
            payload: sparkplug::state_payload(false, *stamp),
        })
    }

    /// The host's own STATE topic, to subscribe to.
    pub(crate) fn subscription(&self) -> Option<String> {
        self.state.as_ref().map(|(topic, _)| topic.clone())
    }

    /// The input connection came up or went down. Down, the broker publishes our will (and
    /// keeps it retained): the next connection must say online again.
    pub(crate) fn link(&mut self, up: bool, mqtt: &Mqtt) {
        self.connected = up;
        self.state_due = true;
        if !up {
            self.figures.host_online = false;
        }
        self.send_state(mqtt);
    }

    /// A received message: our own STATE saying offline while we run (a will of an earlier
    /// connection, delivered late) is answered by saying online again.
    pub(crate) fn saw(&mut self, topic: &str, payload: &[u8], mqtt: &Mqtt) {
        let ours = self.state.as_ref().is_some_and(|(t, _)| t == topic);
        if ours && self.online_wanted && sparkplug::state_says_offline(payload) {
            self.figures.host_online = false;
            self.state_due = true;
            self.send_state(mqtt);
        }
    }

    /// A PUBACK: `true` if it was for one of ours (then nothing else is for it).
    pub(crate) fn acked(&mut self, output_id: &str) -> bool {
        if !output_id.starts_with(ID_PREFIX) {
            return false;
        }
        if let Some(Some(online)) = self.inflight.remove(output_id) {
            let was = std::mem::replace(&mut self.figures.host_online, online);
            if online && !was {
                crate::event!(info, "sparkplug_host_online";
                    "sparkplug: the broker holds this host's STATE as online ({})",
                    self.state.as_ref().map_or("", |s| s.0.as_str())
                );
            }
        }
        true
    }

    /// Stopping cleanly: say offline (then [`Host::settled`] tells when it is acknowledged).
    pub(crate) fn stop(&mut self, mqtt: &Mqtt) {
        self.online_wanted = false;
        self.state_due = true;
        self.send_state(mqtt);
    }

    /// Nothing of ours awaits a PUBACK, and no STATE waits to go (or it cannot: no
    /// connection, whose loss published the will).
    pub(crate) fn settled(&self) -> bool {
        !self.connected || (self.inflight.is_empty() && !(self.state_due && self.state.is_some()))
    }

    /// Every tick: a STATE the window had no room for.
    pub(crate) fn tick(&mut self, mqtt: &Mqtt) {
        self.send_state(mqtt);
    }

    fn next_id(&mut self, what: &str) -> String {
        self.next_id += 1;
        format!("{ID_PREFIX}{what}/{}", self.next_id)
    }

    fn send_state(&mut self, mqtt: &Mqtt) {
        let Some((topic, stamp)) = self.state.clone() else {
            return;
        };
        if !self.state_due || !self.connected {
            return;
        }
        let online = self.online_wanted;
        let id = self.next_id("state");
        match mqtt.publish(
            id.clone(),
            &topic,
            sparkplug::state_payload(online, stamp),
            true,
        ) {
            Ok(()) => {
                self.state_due = false;
                self.inflight.insert(id, Some(online));
            }
            Err(MqttError::InflightFull { .. }) => {} // the next tick tries again
            Err(e) => crate::event!(warn, "sparkplug_state_not_sent";
                "sparkplug: cannot publish STATE to {topic}: {e}"),
        }
    }

    /// What the live loop's processing reported: counted, logged and, with `rebirth`,
    /// answered (see the module docs).
    pub(crate) fn notices(
        &mut self,
        notices: Vec<Notice>,
        mqtt: &Mqtt,
        now: Instant,
        wall_ms: u64,
    ) {
        for n in notices {
            let what = match n.kind {
                NoticeKind::SeqGap { last, got } => {
                    self.figures.seq_gaps += 1;
                    format!("seq jumped from {last} to {got} (messages lost)")
                }
                NoticeKind::UnknownMetric { alias } => {
                    self.figures.unknown_metrics += 1;
                    match alias {
                        Some(a) => format!("alias {a} is not in its BIRTH"),
                        None => "a metric is not in its BIRTH".into(),
                    }
                }
                NoticeKind::NoSession => {
                    self.figures.no_session += 1;
                    "DATA without a live session (no BIRTH seen since it started or died)".into()
                }
            };
            let node = (n.group, n.edge_node);
            if self
                .asked
                .get(&node)
                .is_some_and(|at| now.saturating_duration_since(*at) < REBIRTH_INTERVAL)
            {
                continue;
            }
            let shown = format!("{}/{}", Shown(&node.0), Shown(&node.1));
            if self.rebirth && self.connected {
                let (topic, payload) = sparkplug::rebirth_request(&node.0, &node.1, wall_ms);
                let id = self.next_id("rebirth");
                match mqtt.publish(id.clone(), &topic, payload, false) {
                    Ok(()) => {
                        self.inflight.insert(id, None);
                        self.figures.rebirths_sent += 1;
                        crate::event!(warn, "sparkplug_rebirth_requested", key = shown;
                            "sparkplug: edge node {shown}: {what}; asked it to rebirth");
                    }
                    Err(MqttError::InflightFull { .. }) => continue, // the next notice asks
                    Err(e) => crate::event!(warn, "sparkplug_rebirth_not_sent", key = shown;
                        "sparkplug: cannot ask {shown} to rebirth: {e}"),
                }
            } else {
                crate::event!(warn, "sparkplug_session_notice", key = shown;
                    "sparkplug: edge node {shown}: {what}{}",
                    if self.rebirth {
                        "; not connected, so no rebirth request"
                    } else {
                        " ([sparkplug] rebirth = false: no rebirth request)"
                    }
                );
            }
            if self.asked.len() >= ASKED_MAX {
                self.asked
                    .retain(|_, at| now.saturating_duration_since(*at) < REBIRTH_INTERVAL);
                if self.asked.len() >= ASKED_MAX {
                    self.asked.clear();
                }
            }
            self.asked.insert(node, now);
        }
    }
}
