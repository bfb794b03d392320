//! SIGHUP: re-read the config file and carry out the plan [`crate::config::reload::plan`]
//! makes from the running and the new config: the keys whose table row says a SIGHUP
//! applies them are copied and used; every other change is reported for a restart. A config
//! with problems changes nothing.
//!
//! Pipelines never change here: results leave before their checkpoint, so a pipeline change
//! must take effect at a checkpoint boundary, which the restart gives (a clean stop
//! checkpoints everything; after a crash, `boundary` replays the tail under the old
//! pipelines first).

use super::Agent;

impl Agent {
    pub(super) fn reload(&mut self) {
        crate::notify::reloading();
        match crate::config::load(&self.cfg.source) {
            Err(e) => log::error!("reload: {e}; keeping the running configuration"),
            Ok(new) => {
                let plan = crate::config::reload::plan(&self.cfg, &new);
                plan.apply(&mut self.cfg, &new);
                crate::logging::set_level(self.cfg.logging.level);
                self.log.set_max_size(self.cfg.log.max_size);
                if plan.applies("savepoint.interval") {
                    self.reschedule_savepoints();
                }
                if plan.restart.is_empty() {
                    log::info!(
                        "reload: {} ({})",
                        plan.describe(),
                        self.cfg.source.display()
                    );
                } else {
                    log::warn!("reload: {}", plan.describe());
                }
            }
        }
        crate::notify::ready();
    }
}
