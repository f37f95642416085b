//! The dynamic supervisor with real actors: every restart type, panics,
//! the per-child budget, the supervisor's intensity, limits, terminate and
//! orderly shutdown.

use super::dynamic::{shutdown, start_actor, start_child, terminate_child};
use super::tests::{eventually, worker, Log, Worker, WorkerMsg};
use super::*;
use ractor::{Actor, ActorProcessingErr, ActorRef, ActorStatus, SupervisionEvent};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The owner: links the supervisor under itself and records what it hears.
struct Owner;

#[derive(Clone, Default)]
struct Heard {
    exits: Arc<Mutex<Vec<ChildExit>>>,
    restarts: Arc<Mutex<Vec<String>>>,
    supervisor_failed: Arc<Mutex<bool>>,
}

impl Heard {
    fn exits(&self) -> Vec<ChildExit> {
        self.exits.lock().unwrap().clone()
    }
}

impl Actor for Owner {
    type Msg = ();
    type State = Heard;
    type Arguments = Heard;

    async fn pre_start(&self, _: ActorRef<()>, h: Heard) -> Result<Heard, ActorProcessingErr> {
        Ok(h)
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        event: SupervisionEvent,
        h: &mut Heard,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(..) = event {
            *h.supervisor_failed.lock().unwrap() = true;
        }
        Ok(())
    }
}

async fn setup(spec: DynamicSpec) -> (ActorRef<()>, ActorRef<DynamicMsg>, Heard) {
    let heard = Heard::default();
    let (owner, _) = Actor::spawn(None, Owner, heard.clone()).await.unwrap();
    let (e, r) = (heard.exits.clone(), heard.restarts.clone());
    let spec = spec
        .on_exit(move |x| e.lock().unwrap().push(x))
        .on_restart(move |id, _| r.lock().unwrap().push(id.to_owned()));
    let sup = DynamicSupervisor::start_linked(spec, owner.get_cell())
        .await
        .unwrap();
    (owner, sup, heard)
}

async fn children(sup: &ActorRef<DynamicMsg>) -> Vec<String> {
    ractor::call!(sup, DynamicMsg::WhichChildren)
        .unwrap()
        .into_iter()
        .map(|(id, _)| id)
        .collect()
}

#[tokio::test]
async fn a_panicking_temporary_child_ends_alone_and_is_reported() {
    let (owner, sup, heard) = setup(DynamicSpec::new("t")).await;
    let log = Log::default();
    let a: ActorRef<WorkerMsg> = start_actor(&sup, worker("a", Restart::Temporary, &log))
        .await
        .unwrap();
    let _b = start_child(&sup, worker("b", Restart::Temporary, &log))
        .await
        .unwrap();
    a.send_message(WorkerMsg::Panic).unwrap();
    eventually(|| !heard.exits().is_empty()).await;
    let exit = heard.exits().remove(0);
    assert_eq!(exit.id, "a");
    assert!(!exit.restarting);
    assert!(matches!(exit.exit, Exit::Abnormal(ref why) if why.contains("injected panic")));
    assert_eq!(children(&sup).await, vec!["b".to_owned()]);
    assert_eq!(log.starts_of("a"), 1, "temporary: never restarted");
    assert_eq!(sup.get_status(), ActorStatus::Running);
    owner.stop(None);
}

#[tokio::test]
async fn transient_restarts_after_a_crash_not_after_a_normal_exit() {
    let (owner, sup, heard) = setup(DynamicSpec::new("t")).await;
    let log = Log::default();
    let a: ActorRef<WorkerMsg> = start_actor(&sup, worker("a", Restart::Transient, &log))
        .await
        .unwrap();
    a.send_message(WorkerMsg::Fail).unwrap();
    eventually(|| log.starts_of("a") == 2).await;
    eventually(|| heard.restarts.lock().unwrap().len() == 1).await;
    assert!(heard.exits()[0].restarting);
    let list = ractor::call!(sup, DynamicMsg::WhichChildren).unwrap();
    let a: ActorRef<WorkerMsg> = list[0].1.clone().unwrap().into();
    a.send_message(WorkerMsg::Exit(None)).unwrap();
    eventually(|| heard.exits().len() == 2).await;
    assert_eq!(heard.exits()[1].exit, Exit::Normal);
    assert!(!heard.exits()[1].restarting);
    assert!(children(&sup).await.is_empty());
    assert_eq!(log.starts_of("a"), 2);
    owner.stop(None);
}

#[tokio::test]
async fn permanent_restarts_even_after_a_normal_exit_but_never_after_shutdown() {
    let (owner, sup, heard) = setup(DynamicSpec::new("t")).await;
    let log = Log::default();
    let a: ActorRef<WorkerMsg> = start_actor(&sup, worker("a", Restart::Permanent, &log))
        .await
        .unwrap();
    a.send_message(WorkerMsg::Exit(None)).unwrap();
    eventually(|| log.starts_of("a") == 2).await;
    let list = ractor::call!(sup, DynamicMsg::WhichChildren).unwrap();
    let a: ActorRef<WorkerMsg> = list[0].1.clone().unwrap().into();
    a.send_message(WorkerMsg::Exit(Some("shutdown:replaced".into())))
        .unwrap();
    eventually(|| heard.exits().len() == 2).await;
    assert_eq!(heard.exits()[1].exit, Exit::Shutdown("replaced".into()));
    assert!(!heard.exits()[1].restarting);
    owner.stop(None);
}

#[tokio::test]
async fn past_its_budget_a_child_is_given_up_and_the_supervisor_lives() {
    let (owner, sup, heard) = setup(DynamicSpec::new("t")).await;
    let log = Log::default();
    let budget = Intensity {
        max_restarts: 2,
        period: Duration::from_secs(60),
    };
    start_child(&sup, worker("mcp", Restart::Transient, &log).budget(budget))
        .await
        .unwrap();
    for n in 1..=3 {
        eventually(|| log.starts_of("mcp") == n).await;
        let list = ractor::call!(sup, DynamicMsg::WhichChildren).unwrap();
        let Some(cell) = list.first().and_then(|c| c.1.clone()) else {
            panic!("child {n} not running");
        };
        ActorRef::<WorkerMsg>::from(cell)
            .send_message(WorkerMsg::Panic)
            .unwrap();
        eventually(|| heard.exits().len() == n).await;
    }
    let exits = heard.exits();
    assert_eq!(
        exits.iter().map(|e| e.restarting).collect::<Vec<_>>(),
        vec![true, true, false]
    );
    assert!(children(&sup).await.is_empty());
    assert_eq!(log.starts_of("mcp"), 3);
    assert_eq!(sup.get_status(), ActorStatus::Running);
    owner.stop(None);
}

#[tokio::test]
async fn past_its_intensity_the_supervisor_fails_to_its_owner() {
    let spec = DynamicSpec::new("t").intensity(Intensity {
        max_restarts: 1,
        period: Duration::from_secs(60),
    });
    let (owner, sup, heard) = setup(spec).await;
    let log = Log::default();
    let a: ActorRef<WorkerMsg> = start_actor(&sup, worker("a", Restart::Transient, &log))
        .await
        .unwrap();
    let b: ActorRef<WorkerMsg> = start_actor(&sup, worker("b", Restart::Transient, &log))
        .await
        .unwrap();
    a.send_message(WorkerMsg::Fail).unwrap();
    eventually(|| log.starts_of("a") == 2).await;
    b.send_message(WorkerMsg::Fail).unwrap();
    eventually(|| *heard.supervisor_failed.lock().unwrap()).await;
    // The restarted `a` (the one child still alive) was stopped on the way
    // out; a failed actor skips post_stop, so only it is in the log.
    eventually(|| log.stops.lock().unwrap().iter().any(|s| s == "a")).await;
    assert_eq!(sup.get_status(), ActorStatus::Stopped);
    owner.stop(None);
}

#[tokio::test]
async fn limits_duplicates_and_failed_starts_are_refused() {
    let (owner, sup, _heard) = setup(DynamicSpec::new("t").max_children(1)).await;
    let log = Log::default();
    start_child(&sup, worker("a", Restart::Temporary, &log))
        .await
        .unwrap();
    assert_eq!(
        start_child(&sup, worker("a", Restart::Temporary, &log))
            .await
            .unwrap_err(),
        StartChildError::AlreadyStarted("a".into())
    );
    assert_eq!(
        start_child(&sup, worker("b", Restart::Temporary, &log))
            .await
            .unwrap_err(),
        StartChildError::MaxChildren(1)
    );
    assert!(terminate_child(&sup, "a").await);
    assert!(!terminate_child(&sup, "a").await);
    let failing = ChildSpec::new("c", Restart::Transient, |_| async {
        Err::<ractor::ActorCell, _>("no".to_owned())
    });
    assert!(matches!(
        start_child(&sup, failing).await,
        Err(StartChildError::Failed(_))
    ));
    assert!(
        children(&sup).await.is_empty(),
        "a failed start is not kept"
    );
    owner.stop(None);
}

#[tokio::test]
async fn terminate_reports_nothing_and_shutdown_stops_every_child_in_time() {
    let (owner, sup, heard) = setup(DynamicSpec::new("t")).await;
    let log = Log::default();
    for id in ["a", "b", "c"] {
        start_child(&sup, worker(id, Restart::Permanent, &log))
            .await
            .unwrap();
    }
    assert!(terminate_child(&sup, "a").await);
    // One child is stuck in a handler: the shutdown timeout kills it.
    let list = ractor::call!(sup, DynamicMsg::WhichChildren).unwrap();
    let stuck = list.iter().find(|c| c.0 == "b").unwrap().1.clone().unwrap();
    start_child(
        &sup,
        worker("d", Restart::Temporary, &log).shutdown_timeout(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let _ = stuck;
    let list = ractor::call!(sup, DynamicMsg::WhichChildren).unwrap();
    let d: ActorRef<WorkerMsg> = list
        .iter()
        .find(|c| c.0 == "d")
        .unwrap()
        .1
        .clone()
        .unwrap()
        .into();
    d.send_message(WorkerMsg::Block(Duration::from_secs(3600)))
        .unwrap();
    shutdown(&sup, Duration::from_secs(20)).await;
    assert_eq!(sup.get_status(), ActorStatus::Stopped);
    let stops = log.stops.lock().unwrap().clone();
    for id in ["a", "b", "c"] {
        assert!(stops.iter().any(|s| s == id), "{id} stopped in order");
    }
    assert!(
        heard.exits().is_empty(),
        "no exit is reported for stops the owner asked for"
    );
    owner.stop(None);
}

#[tokio::test]
async fn temporary_specs_start_actors_from_their_arguments() {
    let (owner, sup, _heard) = setup(DynamicSpec::new("t")).await;
    let log = Log::default();
    let spec = ChildSpec::temporary("w", Worker, ("w".to_owned(), log.clone()));
    start_child(&sup, spec).await.unwrap();
    assert_eq!(log.starts_of("w"), 1);
    owner.stop(None);
}

/// On tokio's paused clock: a ten-minute backoff is honoured to the
/// millisecond without the test waiting ten minutes.
#[tokio::test(start_paused = true)]
async fn a_restart_waits_for_its_backoff_on_the_paused_clock() {
    let (owner, sup, heard) = setup(DynamicSpec::new("t")).await;
    let log = Log::default();
    let ten_minutes = Duration::from_secs(600);
    let backoff = Backoff {
        min: ten_minutes,
        max: ten_minutes,
    };
    // With `random` in [0, 1] the delay lies in [5, 10] minutes.
    let a: ActorRef<WorkerMsg> =
        start_actor(&sup, worker("a", Restart::Transient, &log).backoff(backoff))
            .await
            .unwrap();
    a.send_message(WorkerMsg::Fail).unwrap();
    eventually(|| heard.exits().len() == 1).await;
    assert!(heard.exits()[0].restarting);
    tokio::time::sleep(Duration::from_secs(299)).await;
    assert_eq!(
        log.starts_of("a"),
        1,
        "not before the backoff's lower bound"
    );
    tokio::time::sleep(Duration::from_secs(302)).await;
    eventually(|| log.starts_of("a") == 2).await;
    assert_eq!(heard.restarts.lock().unwrap().as_slice(), ["a".to_owned()]);
    owner.stop(None);
}

/// A child that ends (abnormally) as soon as it has started.
#[derive(Clone)]
struct Quitter;

impl Actor for Quitter {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn post_start(&self, me: ActorRef<()>, _: &mut ()) -> Result<(), ActorProcessingErr> {
        me.stop(Some("lost: quit at once".into()));
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_child_that_ends_at_once_is_still_seen_ending() {
    // Its exit can overtake the supervisor's own `Restarted` message; each
    // one must still count, until the budget is spent.
    for _ in 0..20 {
        let (owner, sup, heard) = setup(DynamicSpec::new("t")).await;
        let budget = Intensity {
            max_restarts: 3,
            period: Duration::from_secs(60),
        };
        let spec = ChildSpec::restartable("q", Restart::Transient, Quitter, ()).budget(budget);
        start_child(&sup, spec).await.unwrap();
        eventually(|| heard.exits().len() == 4).await;
        let exits = heard.exits();
        assert_eq!(
            exits.iter().map(|e| e.restarting).collect::<Vec<_>>(),
            vec![true, true, true, false]
        );
        assert!(children(&sup).await.is_empty());
        owner.stop(None);
    }
}
