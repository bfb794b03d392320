//! The Sparkplug B room of the engine (a child module of `engine`, so it shares the
//! engine's private overlay): one log record in, its session changes and many events out.
//!
//! Each metric value goes through [`Engine::apply_event`] like a JSON event: the same dedup
//! by event ID, the same windows, lateness and limits, the same emit modes, one after the
//! other in the order the message carries them. So the guarantees per event are the JSON
//! ones; per record, the session change and every accepted event land in the same batch,
//! hence the same checkpoint, and replay recomputes all of it. What one record refuses (a
//! value of a type that does not aggregate, an unknown alias, a late value) makes one dead
//! letter for the record, which lists them; its other values still count.

use std::collections::{BTreeMap, BTreeSet};

use super::super::field::{Field, TemplatePart};
use super::super::sparkplug::session::{self, Cut, Entries, Entry, NoticeKind};
use super::super::sparkplug::{self, Topic};
use super::{
    Engine, EventOutcome, Given, NOTICES_MAX, Notice, Outcome, Parsed, ReadError, ReadState,
    Record, Refusal, check_key,
};
use crate::pipeline::spec::Aggregate;

/// Refusals listed in one record's dead letter; the rest are counted.
const REFUSALS_LISTED: usize = 8;

/// The engine's overlay of Sparkplug entries over the last checkpoint, for one pipeline.
struct View<'a, R: ReadState> {
    base: &'a R,
    overlay: &'a mut BTreeMap<(String, Vec<u8>), Option<Entry>>,
    pipeline: &'a str,
}

impl<R: ReadState> Entries for View<'_, R> {
    fn get(&mut self, key: &[u8]) -> Result<Option<Entry>, ReadError> {
        match crate::pipeline::state_key::at(self.overlay, self.pipeline, key) {
            Some(e) => Ok(e.clone()),
            None => self.base.sparkplug(self.pipeline, key),
        }
    }

    fn put(&mut self, key: Vec<u8>, entry: Option<Entry>) {
        self.overlay.insert((self.pipeline.to_string(), key), entry);
    }

    fn keys(&mut self, prefix: &[u8]) -> Result<Vec<Vec<u8>>, ReadError> {
        let mut keys: BTreeSet<Vec<u8>> = self
            .base
            .sparkplug_keys(self.pipeline, prefix)?
            .into_iter()
            .collect();
        let from = (self.pipeline.to_string(), prefix.to_vec());
        for ((p, k), e) in self.overlay.range(from..) {
            if p != self.pipeline || !k.starts_with(prefix) {
                break;
            }
            match e {
                Some(_) => keys.insert(k.clone()),
                None => keys.remove(k),
            };
        }
        Ok(keys.into_iter().collect())
    }
}

/// The key template filled for one metric, cut once it is longer than `max` (the key check
/// then refuses it as too long).
fn render_key(key: &Field, topic: &Topic<'_>, device: &str, metric: &str, max: usize) -> String {
    use crate::pipeline::field::SparkplugPart as P;
    let part = |p: P| match p {
        P::Group => topic.group,
        P::EdgeNode => topic.edge_node,
        P::Device => device,
        P::Metric => metric,
    };
    let mut out = String::new();
    let parts = match key {
        Field::Template(parts) => parts.as_slice(),
        Field::Sparkplug(p) => return part(*p).to_string(),
        _ => return out,
    };
    for piece in parts {
        if out.len() > max {
            break;
        }
        match piece {
            TemplatePart::Literal(l) => out.push_str(l),
            TemplatePart::Field(Field::Sparkplug(p)) => out.push_str(part(*p)),
            TemplatePart::Field(_) => {}
        }
    }
    out
}

/// One dead letter for the refusals of one record: the first one's reason, and a list.
fn summary(refused: &[(String, Refusal)], values: usize) -> Refusal {
    let mut detail = format!("{} of {values} metric values refused: ", refused.len());
    for (i, (label, r)) in refused.iter().take(REFUSALS_LISTED).enumerate() {
        if i > 0 {
            detail.push_str("; ");
        }
        detail.push_str(&format!("{label}: {} ({})", r.reason, r.detail));
    }
    if refused.len() > REFUSALS_LISTED {
        detail.push_str(&format!("; and {} more", refused.len() - REFUSALS_LISTED));
    }
    Refusal {
        reason: refused[0].1.reason,
        detail,
    }
}

impl Engine {
    /// One Sparkplug record for pipeline `p` (see the module docs).
    pub(super) fn apply_sparkplug<R: ReadState>(
        &mut self,
        base: &R,
        p: usize,
        rec: &Record,
    ) -> Result<Outcome, ReadError> {
        let topic = match Topic::parse(&rec.topic) {
            Ok(Some(t)) => t,
            Ok(None) => return Ok(self.filtered(p)),
            Err(r) => return self.dead(base, p, rec, r),
        };
        let payload = match sparkplug::decode(&rec.payload) {
            Ok(x) => x,
            Err(r) => return self.dead(base, p, rec, r),
        };
        // The same bytes again are the same message, delivered again: skipped whole, before
        // the session sees it. Not an NDEATH: a will carries no `seq` and often no time, so
        // two deaths may well be byte-identical; one delivered again finds its session
        // already over (or a newer one, whose `bdSeq` it does not carry) and changes
        // nothing.
        let message = sparkplug::message_hash(&rec.topic, &rec.payload);
        // Bounded as a value's ID is (`max_id_len`, no control character: what the ledger
        // may hold); past it every value's ID, which holds the same parts and more, is
        // refused too, so no value of the message can count twice either.
        let max = self.specs[p].max_id_len;
        let message_id = (topic.kind != sparkplug::Kind::NDeath)
            .then(|| sparkplug::message_id(&topic, message))
            .filter(|id| id.len() <= max && !id.chars().any(char::is_control));
        if let Some(id) = &message_id {
            if self.seen_within_window(base, p, id)? {
                self.progress.pipelines[p].counters.duplicates += 1;
                return Ok(Outcome::Duplicate);
            }
        }
        let out = self.sparkplug_message(base, p, rec, &topic, &payload, message)?;
        if let Some(id) = message_id {
            let now = self.clock(p);
            self.remember(p, &id, now);
        }
        Ok(out)
    }

    /// One message, not seen before, through its session and the pipeline's events.
    fn sparkplug_message<R: ReadState>(
        &mut self,
        base: &R,
        p: usize,
        rec: &Record,
        topic: &Topic<'_>,
        payload: &sparkplug::Payload,
        message: u64,
    ) -> Result<Outcome, ReadError> {
        let (specs, batch) = (&self.specs, &mut self.batch);
        let spec = &specs[p];
        let wanted = |m: &str| {
            spec.metrics
                .as_ref()
                .is_none_or(|l| l.iter().any(|x| x == m))
        };
        let mut view = View {
            base,
            overlay: &mut batch.sparkplug,
            pipeline: &spec.name,
        };
        let step = match session::step(&mut view, topic, payload, rec.received_at_ms, &wanted) {
            Ok(s) => s,
            Err(r) => {
                if r.reason == "no_session" {
                    self.notice(topic, NoticeKind::NoSession);
                }
                return self.dead(base, p, rec, r);
            }
        };
        for kind in step.notices {
            self.notice(topic, kind);
        }
        for cut in &step.cuts {
            self.cut(base, p, rec, topic, cut)?;
        }
        let values = step.samples.len();
        let mut refused: Vec<(String, Refusal)> = Vec::new();
        let (mut applied, mut duplicates) = (None, 0u64);
        for s in step.samples {
            let label = if s.device.is_empty() {
                s.metric.clone()
            } else {
                format!("{}/{}", s.device, s.metric)
            };
            let value = match s.value {
                Err(r) => {
                    refused.push((label, r));
                    continue;
                }
                Ok(None) => {
                    let cut = Cut {
                        device: s.device,
                        metric: s.metric,
                        time_ms: s.time_ms,
                    };
                    self.cut(base, p, rec, topic, &cut)?;
                    continue;
                }
                Ok(Some(v)) => v,
            };
            let spec = &self.specs[p];
            let key = render_key(&spec.key, topic, &s.device, &s.metric, spec.max_key_len);
            let id = sparkplug::event_id(
                topic,
                &s.device,
                &s.metric,
                (s.time_ms, s.stamped),
                s.historical,
                (message, s.seq),
            );
            if id.len() > spec.max_id_len || id.chars().any(char::is_control) {
                let r = Refusal {
                    reason: "id_too_long",
                    detail: format!(
                        "the event ID is {} bytes, max_id_len is {} (or holds a control \
                         character)",
                        id.len(),
                        spec.max_id_len
                    ),
                };
                refused.push((label, r));
                continue;
            }
            let ev = Parsed {
                event_id: id,
                key,
                value,
                event_time_ms: Some(s.time_ms),
            };
            let ev = match check_key(spec, ev) {
                Ok(ev) => ev,
                Err(r) => {
                    refused.push((label, r));
                    continue;
                }
            };
            let given = Given {
                historical: s.historical,
                prior: s.prior,
            };
            match self.apply_event(base, p, rec, ev, given)? {
                EventOutcome::Applied { key, version } => applied = Some((key, version)),
                EventOutcome::Duplicate => duplicates += 1,
                EventOutcome::Refused(r) => refused.push((label, r)),
            }
        }
        if !refused.is_empty() {
            return self.dead(base, p, rec, summary(&refused, values));
        }
        Ok(match applied {
            Some((key, version)) => Outcome::Applied { key, version },
            None if duplicates > 0 => Outcome::Duplicate,
            None => self.filtered(p),
        })
    }

    /// A record that gives this pipeline no value (a DEATH, a STATE, a command, a BIRTH of
    /// metrics it does not take): skipped and counted as filtered.
    fn filtered(&mut self, p: usize) -> Outcome {
        self.progress.pipelines[p].counters.filtered += 1;
        Outcome::Filtered
    }

    fn notice(&mut self, topic: &Topic<'_>, kind: NoticeKind) {
        if self.notices.len() < NOTICES_MAX {
            self.notices.push(Notice {
                group: topic.group.to_string(),
                edge_node: topic.edge_node.to_string(),
                kind,
            });
        }
    }

    /// A metric's value stops at `cut.time_ms`: the twa of the window that holds that time
    /// (if the key has state there) takes a point without a value, and hands it on to the
    /// next window. Nothing else changes: a cut is no event, so it neither moves the
    /// watermark nor enters the dedup ledger.
    fn cut<R: ReadState>(
        &mut self,
        base: &R,
        p: usize,
        rec: &Record,
        topic: &Topic<'_>,
        cut: &Cut,
    ) -> Result<(), ReadError> {
        let spec = &self.specs[p];
        if !spec.aggregate.all().contains(&Aggregate::Twa)
            || spec
                .metrics
                .as_ref()
                .is_some_and(|l| !l.contains(&cut.metric))
            || cut.time_ms.saturating_sub(rec.received_at_ms) > spec.max_future_ms
        {
            return Ok(());
        }
        let key = render_key(&spec.key, topic, &cut.device, &cut.metric, spec.max_key_len);
        if key.is_empty() || key.len() > spec.max_key_len {
            return Ok(());
        }
        let start = match spec.window {
            None => None,
            Some(w) if w.slide_ms.is_none() => {
                let start = cut.time_ms - cut.time_ms % w.size_ms.max(1);
                if start < w.open_from(self.progress.pipelines[p].max_event_time_ms) {
                    return Ok(()); // closed: its result is final
                }
                Some(start)
            }
            Some(_) => return Ok(()),
        };
        let Ok(slot) = self.slot_for(p, &key, start) else {
            return Ok(());
        };
        let Some(st) = self.state_get(base, &spec.name, &slot.skey)? else {
            return Ok(());
        };
        let Some(new) = st.with_twa(|t| t.insert(cut.time_ms, None)) else {
            return Ok(());
        };
        let slots = [slot];
        let carried = self.carry_on(base, p, &key, &slots, std::slice::from_ref(&new))?;
        let [slot] = slots;
        self.store_state(p, slot, new);
        for (slot, st) in carried {
            self.store_state(p, slot, st);
        }
        Ok(())
    }
}
