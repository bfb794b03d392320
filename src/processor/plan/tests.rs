//! The start plan as a table of cases: what the last run left, the config, `--reset-pipeline`
//! → what the start does. No disk, no broker: [`decide`] is a function of its arguments.
//! Each rule of the module docs has a row that fails when the rule is broken (say, the
//! settle skipping backfilling pipelines again: the `backfill_changed` rows then give
//! `Continue` where they expect a new generation).

use super::*;

/// A pipeline `name`; `extra` lines may set `value` and `aggregate` (else `/v` and `sum`).
fn spec(name: &str, extra: &str) -> PipelineSpec {
    let mut body = format!(
        "name = \"{name}\"\ntopics = [\"in/#\"]\nformat = \"json\"\nevent_id = \"/id\"\n\
         key = \"/k\"\noutput_topic = \"{name}/{{key}}\"\n{extra}\n"
    );
    for (key, default) in [("value", "\"/v\""), ("aggregate", "\"sum\"")] {
        if !extra.contains(&format!("{key} =")) {
            body.push_str(&format!("{key} = {default}\n"));
        }
    }
    crate::config::pipeline_from_toml(&body).unwrap()
}

/// A stored pipeline written by `s`, in `generation`, backfilling from `backfill` if any.
fn stored(s: &PipelineSpec, generation: u32, backfill: Option<u64>) -> PipelineProgress {
    PipelineProgress {
        keys: 3,
        max_version: 9,
        backfill: backfill.map(|next| Backfill { next, clock_ms: 0 }),
        ..PipelineProgress::new(s, generation)
    }
}

fn found(pipelines: Vec<PipelineProgress>, last_run: LastRun) -> Found {
    Found {
        with_data: pipelines.iter().map(|p| p.name.clone()).collect(),
        generations: {
            let mut g = Generations::in_memory();
            for p in &pipelines {
                g.observe(&p.name, p.generation);
            }
            g
        },
        progress: Progress {
            next_offset: 100,
            pipelines,
            ..Default::default()
        },
        last_run,
        restored: None,
    }
}

/// What a case expects: the settle (with its fallback), the actions, the wiped pipelines.
#[derive(Debug, PartialEq)]
struct Outcome {
    settle: Option<Vec<(String, u32)>>,
    actions: Vec<(String, Action)>,
    wipe: Vec<String>,
}

fn outcome(plan: &Plan) -> Outcome {
    Outcome {
        settle: plan.settle.as_ref().map(|s| s.fallback.clone()),
        actions: plan.actions.clone(),
        wipe: plan.wipe.clone(),
    }
}

fn acts(list: &[(&str, Action)]) -> Vec<(String, Action)> {
    list.iter()
        .map(|(n, a)| (n.to_string(), a.clone()))
        .collect()
}

fn ok(settle: Option<&[(&str, u32)]>, actions: &[(&str, Action)], wipe: &[&str]) -> Outcome {
    Outcome {
        settle: settle.map(|f| f.iter().map(|(n, g)| (n.to_string(), *g)).collect()),
        actions: acts(actions),
        wipe: wipe.iter().map(|s| s.to_string()).collect(),
    }
}

use Action::*;

#[test]
fn the_start_plan_for_each_case_of_what_the_last_run_left() {
    let a = spec("a", "");
    let a_where = spec("a", "where = '/v > 2'");
    let a_max = spec("a", "aggregate = \"max\"");
    let early = spec("b", "start = \"earliest\"");
    let early_where = spec("b", "start = \"earliest\"\nwhere = '/v > 2'");
    let ran = |specs: &[&PipelineSpec]| LastRun::Ran(specs.iter().map(|s| (*s).clone()).collect());
    let none: &[&str] = &[];
    type Case<'a> = (
        &'a str,
        Found,
        Vec<PipelineSpec>,
        &'a [&'a str],
        Result<Outcome, &'a str>,
    );
    let cases: Vec<Case> = vec![
        (
            "a new data directory: everything starts empty in generation 1",
            found(vec![], LastRun::Unknown),
            vec![a.clone(), early.clone()],
            none,
            Ok(ok(
                None,
                &[
                    (
                        "a",
                        Fresh {
                            generation: 1,
                            backfill: false,
                        },
                    ),
                    (
                        "b",
                        Fresh {
                            generation: 1,
                            backfill: true,
                        },
                    ),
                ],
                &[],
            )),
        ),
        (
            "an unchanged restart continues and settles nothing",
            found(vec![stored(&a, 1, None)], ran(&[&a])),
            vec![a.clone()],
            none,
            Ok(ok(None, &[("a", Continue)], &[])),
        ),
        (
            "a changed `where` after a crash settles the tail under the old one first",
            found(vec![stored(&a, 1, None)], ran(&[&a])),
            vec![a_where.clone()],
            none,
            Ok(ok(Some(&[("a", 2)]), &[("a", Continue)], &[])),
        ),
        (
            "a pipeline changed while backfilling goes on in a new generation",
            found(
                vec![stored(&a, 1, None), stored(&early, 1, Some(40))],
                ran(&[&a, &early]),
            ),
            vec![a.clone(), early_where.clone()],
            none,
            Ok(ok(
                Some(&[]),
                &[("a", Continue), ("b", NewGeneration { generation: 2 })],
                &[],
            )),
        ),
        (
            "a backfilling pipeline that did not change resumes where it was",
            found(
                vec![stored(&a, 1, None), stored(&early, 1, Some(40))],
                ran(&[&a, &early]),
            ),
            vec![a_where.clone(), early.clone()],
            none,
            Ok(ok(
                Some(&[("a", 2)]),
                &[("a", Continue), ("b", Continue)],
                &[],
            )),
        ),
        (
            "a pipeline that was backfilling and is no longer configured goes dormant in a new \
             generation",
            found(
                vec![stored(&a, 1, None), stored(&early, 3, Some(40))],
                ran(&[&a, &early]),
            ),
            vec![a.clone()],
            none,
            Ok(ok(
                Some(&[]),
                &[("a", Continue), ("b", NewGeneration { generation: 4 })],
                &[],
            )),
        ),
        (
            "a dormant pipeline stays as it is",
            found(
                vec![stored(&a, 1, None), stored(&early, 2, None)],
                ran(&[&a]),
            ),
            vec![a.clone()],
            none,
            Ok(ok(None, &[("a", Continue), ("b", Dormant)], &[])),
        ),
        (
            "a dormant pipeline named in a reset is dropped with its state",
            found(
                vec![stored(&a, 1, None), stored(&early, 2, None)],
                ran(&[&a]),
            ),
            vec![a.clone()],
            &["b"],
            Ok(ok(None, &[("a", Continue), ("b", Drop)], &["b"])),
        ),
        (
            "after a savepoint restore every stored pipeline goes on in a new generation and \
             nothing is settled",
            Found {
                restored: Some("checkpoint 7".into()),
                ..found(
                    vec![stored(&a, 1, None), stored(&early, 2, None)],
                    ran(&[&a]),
                )
            },
            vec![a_where.clone()],
            none,
            Ok(ok(
                None,
                &[
                    ("a", NewGeneration { generation: 2 }),
                    ("b", NewGeneration { generation: 3 }),
                ],
                &[],
            )),
        ),
        (
            "a store moved aside settles nothing: the pipelines start empty, in a new \
             generation",
            Found {
                with_data: vec![],
                ..found(vec![], ran(&[&a]))
            }
            .with_highest(&[("a", 1)]),
            vec![a_where.clone()],
            none,
            Ok(ok(
                None,
                &[(
                    "a",
                    Fresh {
                        generation: 2,
                        backfill: false,
                    },
                )],
                &[],
            )),
        ),
        (
            "a changed definition is refused",
            found(vec![stored(&a, 1, None)], ran(&[&a])),
            vec![a_max.clone()],
            none,
            Err("IncompatiblePipeline"),
        ),
        (
            "a changed definition named in a reset starts over in a new generation",
            found(vec![stored(&a, 1, None)], ran(&[&a])),
            vec![a_max.clone()],
            &["a"],
            Ok(ok(
                Some(&[]),
                &[(
                    "a",
                    Reset {
                        generation: 2,
                        backfill: false,
                    },
                )],
                &["a"],
            )),
        ),
        (
            "state whose definition the store does not know is refused",
            Found {
                with_data: vec!["a".into()],
                ..found(vec![], LastRun::Unknown)
            },
            vec![a.clone()],
            none,
            Err("UnknownDefinition"),
        ),
        (
            "... and with a reset it is dropped and the pipeline starts above generation 1",
            Found {
                with_data: vec!["a".into()],
                ..found(vec![], LastRun::Unknown)
            },
            vec![a.clone()],
            &["a"],
            Ok(ok(
                None,
                &[(
                    "a",
                    Fresh {
                        generation: 2,
                        backfill: false,
                    },
                )],
                &["a"],
            )),
        ),
        (
            "a reset of a pipeline that exists nowhere is refused",
            found(vec![stored(&a, 1, None)], ran(&[&a])),
            vec![a.clone()],
            &["nope"],
            Err("UnknownReset"),
        ),
        (
            "a record of the last run that does not read stops the start",
            found(
                vec![stored(&a, 1, None)],
                LastRun::Unreadable {
                    file: "pipelines.json".into(),
                    why: "EOF".into(),
                },
            ),
            vec![a.clone()],
            none,
            Err("LastRunUnreadable"),
        ),
        (
            "a reset of a backfilling pipeline backfills again",
            found(vec![stored(&early, 1, Some(10))], ran(&[&early])),
            vec![early.clone()],
            &["b"],
            Ok(ok(
                None,
                &[(
                    "b",
                    Reset {
                        generation: 2,
                        backfill: true,
                    },
                )],
                &["b"],
            )),
        ),
    ];
    for (what, found, specs, reset, want) in cases {
        let reset: Vec<String> = reset.iter().map(|s| s.to_string()).collect();
        let got = decide(&found, &specs, &reset);
        match (got, want) {
            (Ok(plan), Ok(want)) => assert_eq!(outcome(&plan), want, "{what}"),
            (Err(e), Err(kind)) => {
                assert!(format!("{e:?}").starts_with(kind), "{what}: {e:?}")
            }
            (got, want) => panic!("{what}: got {got:?}, want {want:?}"),
        }
    }
}

impl Found {
    fn with_highest(mut self, list: &[(&str, u32)]) -> Found {
        self.generations = Generations::in_memory();
        for (n, g) in list {
            self.generations.observe(n, *g);
        }
        self
    }
}

#[test]
fn a_settle_that_must_wait_puts_the_changed_pipelines_in_a_new_generation() {
    let a = spec("a", "");
    let found = found(vec![stored(&a, 1, None)], LastRun::Ran(vec![a.clone()]));
    let new = spec("a", "where = '/v > 2'");
    let mut plan = decide(&found, std::slice::from_ref(&new), &[]).unwrap();
    assert!(plan.settle.is_some());
    assert!(!plan.changes_progress(), "settling alone changes no record");
    plan.settle_held("outbox.max_entries");
    assert_eq!(plan.settle, None);
    assert_eq!(
        plan.actions,
        acts(&[("a", NewGeneration { generation: 2 })])
    );
    assert_eq!(
        plan.generations.highest("a"),
        Some(2),
        "the generations file learns it"
    );
    let after = plan.apply(&found.progress, &[new]);
    assert_eq!(after.pipelines[0].generation, 2);
    assert_eq!(after.pipelines[0].keys, 3, "its state is kept");
}

#[test]
fn the_plan_applied_keeps_configured_pipelines_first_and_numbers_generations_once() {
    let (a, b) = (spec("a", ""), spec("b", "start = \"earliest\""));
    let mut f = found(vec![stored(&a, 2, None)], LastRun::Unknown);
    f.generations.observe("b", 5);
    let plan = decide(&f, std::slice::from_ref(&b), &[]).unwrap();
    let after = plan.apply(&f.progress, &[b]);
    let names: Vec<_> = after.pipelines.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["b", "a"], "configured first, then dormant");
    assert_eq!(after.pipelines[0].generation, 6, "above every earlier b");
    assert_eq!(after.pipelines[0].backfill, Some(Backfill::default()));
    assert_eq!(
        after.next_offset, 100,
        "the rest of the record is the store's"
    );
    assert_eq!(plan.generations.highest("b"), Some(6));
}

#[test]
fn pipelines_whose_progress_record_cannot_fit_are_refused_dormant_ones_counted() {
    // Definitions of ~3 KB each (a long value pointer): 20 fit, 40 do not.
    let wide = |name: String| spec(&name, &format!("value = \"/{}\"", "v".repeat(3000)));
    let first: Vec<_> = (0..20).map(|i| wide(format!("a{i}"))).collect();
    let second: Vec<_> = (0..20).map(|i| wide(format!("b{i}"))).collect();
    let empty = found(vec![], LastRun::Unknown);
    assert!(decide(&empty, &first, &[]).is_ok(), "20 fit");
    let stored_first = found(
        first.iter().map(|s| stored(s, 1, None)).collect(),
        LastRun::Unknown,
    );
    match decide(&stored_first, &second, &[]) {
        Err(Refusal::ProgressTooLarge {
            bytes,
            limit,
            configured,
            dormant,
        }) => {
            assert!(bytes > limit, "{bytes} <= {limit}");
            assert_eq!((configured, dormant.len()), (20, 20));
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Dropping the dormant ones makes room.
    let reset: Vec<String> = (0..20).map(|i| format!("a{i}")).collect();
    assert!(decide(&stored_first, &second, &reset).is_ok());
}

/// After a restore the restored outbox's results go on in their pipeline's new generation,
/// dormant ones included, and go with a pipeline reset or dropped at that start; at any
/// other start the outbox is left alone.
#[test]
fn a_restore_moves_the_restored_outbox_into_the_new_generations() {
    let (a, b, c, d) = (spec("a", ""), spec("b", ""), spec("c", ""), spec("d", ""));
    let left = || {
        found(
            vec![
                stored(&a, 1, None),
                stored(&b, 4, None),
                stored(&c, 2, None),
                stored(&d, 1, None),
            ],
            LastRun::Ran(vec![a.clone(), b.clone(), c.clone(), d.clone()]),
        )
    };
    let restored = Found {
        restored: Some("checkpoint 7".into()),
        ..left()
    };
    let resets = ["b".to_string(), "d".to_string()];
    let plan = decide(&restored, &[a.clone(), b.clone()], &resets).unwrap();
    assert_eq!(
        plan.outbox,
        vec![
            ("a".to_string(), Some(2)),
            ("c".to_string(), Some(3)),
            ("b".to_string(), None),
            ("d".to_string(), None),
        ]
    );
    assert!(plan.changes_progress());
    let plain = decide(&left(), &[a.clone(), b.clone()], &resets).unwrap();
    assert!(plain.outbox.is_empty(), "{:?}", plain.outbox);
}
