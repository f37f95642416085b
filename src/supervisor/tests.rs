//! Supervisor behaviour with real actors: every restart type against every
//! exit kind, every strategy, intensity, backoff, final exits, attempts and
//! orderly shutdown.

use super::*;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Default)]
pub(super) struct Log {
    pub(super) starts: Arc<Mutex<Vec<String>>>,
    pub(super) stops: Arc<Mutex<Vec<String>>>,
}

impl Log {
    pub(super) fn starts_of(&self, name: &str) -> usize {
        self.starts
            .lock()
            .unwrap()
            .iter()
            .filter(|n| *n == name)
            .count()
    }
}

pub(super) struct Worker;

pub(super) enum WorkerMsg {
    Exit(Option<String>),
    Fail,
    Block(Duration),
    Panic,
}

impl Actor for Worker {
    type Msg = WorkerMsg;
    type State = (String, Log);
    type Arguments = (String, Log);

    async fn pre_start(
        &self,
        _me: ActorRef<WorkerMsg>,
        args: (String, Log),
    ) -> Result<Self::State, ActorProcessingErr> {
        args.1.starts.lock().unwrap().push(args.0.clone());
        Ok(args)
    }

    async fn post_stop(
        &self,
        _me: ActorRef<WorkerMsg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.1.stops.lock().unwrap().push(state.0.clone());
        Ok(())
    }

    async fn handle(
        &self,
        me: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        _state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Exit(reason) => me.stop(reason),
            WorkerMsg::Fail => return Err("boom".into()),
            WorkerMsg::Block(d) => tokio::time::sleep(d).await,
            WorkerMsg::Panic => panic!("injected panic"),
        }
        Ok(())
    }
}

pub(super) fn worker(name: &str, restart: Restart, log: &Log) -> ChildSpec {
    let name = name.to_owned();
    let log = log.clone();
    ChildSpec::new(name.clone(), restart, move |sup: ActorCell| {
        let (name, log) = (name.clone(), log.clone());
        async move {
            Actor::spawn_linked(None, Worker, (name, log), sup)
                .await
                .map(|(a, _)| a.get_cell())
                .map_err(|e| e.to_string())
        }
    })
}

async fn child(sup: &ActorRef<SupervisorMsg>, id: &str) -> Option<ActorRef<WorkerMsg>> {
    let list = ractor::call!(sup, SupervisorMsg::WhichChildren).unwrap();
    list.into_iter()
        .find(|(i, _)| i == id)
        .and_then(|(_, c)| c)
        .map(ActorRef::from)
}

/// Wait until `cond` holds (bounded), so tests never sleep a fixed time.
pub(super) async fn eventually(mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "condition not reached in 10 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn settle(sup: &ActorRef<SupervisorMsg>) {
    // A call round trip drains everything queued before it.
    let _ = ractor::call!(sup, SupervisorMsg::WhichChildren);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _ = ractor::call!(sup, SupervisorMsg::WhichChildren);
}

fn spec(strategy: Strategy, children: Vec<ChildSpec>) -> SupervisorSpec {
    SupervisorSpec {
        strategy,
        intensity: Some(Intensity {
            max_restarts: 100,
            period: Duration::from_secs(5),
        }),
        children,
    }
}

#[tokio::test]
async fn every_restart_type_against_every_exit() {
    let cases = [
        (Restart::Permanent, WorkerMsg::Exit(None), true),
        (Restart::Permanent, WorkerMsg::Fail, true),
        (
            Restart::Permanent,
            WorkerMsg::Exit(Some("lost".into())),
            true,
        ),
        (
            Restart::Permanent,
            WorkerMsg::Exit(Some("shutdown:replaced".into())),
            false,
        ),
        (Restart::Transient, WorkerMsg::Exit(None), false),
        (Restart::Transient, WorkerMsg::Fail, true),
        (
            Restart::Transient,
            WorkerMsg::Exit(Some("lost".into())),
            true,
        ),
        (
            Restart::Transient,
            WorkerMsg::Exit(Some("shutdown".into())),
            false,
        ),
        (Restart::Temporary, WorkerMsg::Exit(None), false),
        (Restart::Temporary, WorkerMsg::Fail, false),
        (
            Restart::Temporary,
            WorkerMsg::Exit(Some("lost".into())),
            false,
        ),
    ];
    for (case, (restart, msg, restarted)) in cases.into_iter().enumerate() {
        let log = Log::default();
        let (sup, _exit) =
            Supervisor::start(spec(Strategy::OneForOne, vec![worker("w", restart, &log)]))
                .await
                .unwrap();
        settle(&sup).await;
        let w = child(&sup, "w").await.unwrap();
        w.send_message(msg).unwrap();
        if restarted {
            eventually(|| log.starts_of("w") == 2).await;
        } else {
            eventually(|| w.get_status() == ractor::ActorStatus::Stopped).await;
            settle(&sup).await;
            assert_eq!(
                log.starts_of("w"),
                1,
                "case {case}: {restart:?} must not restart"
            );
        }
        sup.stop(None);
    }
}

async fn crash_middle(strategy: Strategy) -> Log {
    let log = Log::default();
    let children = ["a", "b", "c"]
        .iter()
        .map(|n| worker(n, Restart::Permanent, &log))
        .collect();
    let (sup, _exit) = Supervisor::start(spec(strategy, children)).await.unwrap();
    settle(&sup).await;
    child(&sup, "b")
        .await
        .unwrap()
        .send_message(WorkerMsg::Fail)
        .unwrap();
    eventually(|| log.starts_of("b") == 2).await;
    settle(&sup).await;
    let list = ractor::call!(sup, SupervisorMsg::WhichChildren).unwrap();
    assert!(
        list.iter().all(|(_, c)| c.is_some()),
        "all children running again"
    );
    sup.stop(None);
    log
}

#[tokio::test]
async fn one_for_one_restarts_only_the_failed_child() {
    let log = crash_middle(Strategy::OneForOne).await;
    assert_eq!(
        (log.starts_of("a"), log.starts_of("b"), log.starts_of("c")),
        (1, 2, 1)
    );
}

#[tokio::test]
async fn one_for_all_restarts_every_child() {
    let log = crash_middle(Strategy::OneForAll).await;
    assert_eq!(
        (log.starts_of("a"), log.starts_of("b"), log.starts_of("c")),
        (2, 2, 2)
    );
    // Restarted in start order.
    let starts = log.starts.lock().unwrap().clone();
    assert_eq!(&starts[3..], &["a", "b", "c"]);
}

#[tokio::test]
async fn rest_for_one_restarts_the_child_and_later_ones() {
    let log = crash_middle(Strategy::RestForOne).await;
    assert_eq!(
        (log.starts_of("a"), log.starts_of("b"), log.starts_of("c")),
        (1, 2, 2)
    );
}

#[tokio::test]
async fn intensity_exceeded_stops_children_and_fails() {
    let log = Log::default();
    let s = SupervisorSpec {
        strategy: Strategy::OneForOne,
        intensity: Some(Intensity {
            max_restarts: 2,
            period: Duration::from_secs(60),
        }),
        children: vec![
            worker("a", Restart::Permanent, &log),
            worker("b", Restart::Permanent, &log),
        ],
    };
    let (sup, exit) = Supervisor::start(s).await.unwrap();
    for round in 0..3 {
        settle(&sup).await;
        let b = child(&sup, "b").await.unwrap();
        b.send_message(WorkerMsg::Fail).unwrap();
        if round < 2 {
            eventually(|| log.starts_of("b") == round + 2).await;
        }
    }
    let exit = tokio::time::timeout(Duration::from_secs(10), exit)
        .await
        .unwrap();
    assert_eq!(exit.unwrap(), SupervisorExit::Meltdown);
    // "a" was stopped in order by the supervisor giving up.
    assert!(log.stops.lock().unwrap().contains(&"a".to_owned()));
}

#[tokio::test]
async fn significant_child_with_final_exit_escalates() {
    let log = Log::default();
    let s = spec(
        Strategy::OneForOne,
        vec![
            worker("sessions", Restart::Permanent, &log),
            worker("connection", Restart::Permanent, &log).significant(),
        ],
    );
    let (sup, exit) = Supervisor::start(s).await.unwrap();
    settle(&sup).await;
    child(&sup, "connection")
        .await
        .unwrap()
        .send_message(WorkerMsg::Exit(Some("shutdown:replaced".into())))
        .unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(10), exit)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        exit,
        SupervisorExit::ChildExited {
            child: "connection".into(),
            exit: Exit::Shutdown("replaced".into())
        }
    );
    assert_eq!(
        log.starts_of("connection"),
        1,
        "a final exit is never restarted"
    );
    assert!(log.stops.lock().unwrap().contains(&"sessions".to_owned()));
}

#[tokio::test]
async fn backoff_delays_restarts_and_attempts_run_out() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let a = attempts.clone();
    let failing = ChildSpec::new("dial", Restart::Permanent, move |_sup: ActorCell| {
        let a = a.clone();
        async move {
            a.fetch_add(1, Ordering::SeqCst);
            Err::<ActorCell, _>("connection refused".to_owned())
        }
    })
    .backoff(Backoff {
        min: Duration::from_millis(40),
        max: Duration::from_millis(200),
    })
    .max_attempts(Some(3));
    let s = SupervisorSpec {
        strategy: Strategy::OneForOne,
        intensity: None,
        children: vec![failing],
    };
    let started = Instant::now();
    let (_sup, exit) = Supervisor::start(s).await.unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(10), exit)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        exit,
        SupervisorExit::Exhausted {
            child: "dial".into()
        }
    );
    // First start + 3 retries.
    assert_eq!(attempts.load(Ordering::SeqCst), 4);
    // Lower bound of the jittered delays: 20 + 40 + 80 ms.
    assert!(started.elapsed() >= Duration::from_millis(140));
}

#[tokio::test]
async fn final_start_error_is_not_retried() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let a = attempts.clone();
    let refused = ChildSpec::new("dial", Restart::Permanent, move |_sup: ActorCell| {
        let a = a.clone();
        async move {
            a.fetch_add(1, Ordering::SeqCst);
            Err::<ActorCell, _>("shutdown:unauthorized".to_owned())
        }
    })
    .significant();
    let (_sup, exit) = Supervisor::start(SupervisorSpec {
        children: vec![refused],
        ..Default::default()
    })
    .await
    .unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(10), exit)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        exit,
        SupervisorExit::ChildExited {
            child: "dial".into(),
            exit: Exit::Shutdown("unauthorized".into())
        }
    );
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn orderly_shutdown_is_reverse_order_and_kills_stuck_children() {
    let log = Log::default();
    let s = spec(
        Strategy::OneForOne,
        vec![
            worker("first", Restart::Permanent, &log),
            worker("second", Restart::Permanent, &log),
            worker("stuck", Restart::Permanent, &log).shutdown_timeout(Duration::from_millis(100)),
        ],
    );
    let (sup, exit) = Supervisor::start(s).await.unwrap();
    settle(&sup).await;
    child(&sup, "stuck")
        .await
        .unwrap()
        .send_message(WorkerMsg::Block(Duration::from_secs(3600)))
        .unwrap();
    let started = Instant::now();
    sup.stop(None);
    let exit = tokio::time::timeout(Duration::from_secs(10), exit)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(exit, SupervisorExit::Stopped);
    assert!(
        started.elapsed() < Duration::from_secs(3000),
        "the stuck child was killed"
    );
    // A killed actor skips post_stop, so only the other two report, in reverse order.
    assert_eq!(
        *log.stops.lock().unwrap(),
        vec!["second".to_owned(), "first".to_owned()]
    );
}

#[tokio::test]
async fn dynamic_children_start_and_terminate() {
    let log = Log::default();
    let (sup, _exit) = Supervisor::start(SupervisorSpec::default()).await.unwrap();
    let cell = ractor::call!(sup, |r| SupervisorMsg::StartChild(
        worker("dyn", Restart::Temporary, &log),
        Some(r)
    ))
    .unwrap();
    assert!(cell.is_ok());
    let dup = ractor::call!(sup, |r| SupervisorMsg::StartChild(
        worker("dyn", Restart::Temporary, &log),
        Some(r)
    ))
    .unwrap();
    assert!(dup.is_err(), "ids are unique");
    let gone = ractor::call!(sup, |r| SupervisorMsg::TerminateChild(
        "dyn".into(),
        Some(r)
    ))
    .unwrap();
    assert!(gone);
    assert_eq!(*log.stops.lock().unwrap(), vec!["dyn".to_owned()]);
    sup.stop(None);
}
