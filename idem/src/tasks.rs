//! A task group with one cancellation signal: the Rust counterpart of Go's errgroup. When any task ends
//! with an error (or ends at all before shutdown was asked), every other task is told to stop; the group's
//! result is the first error.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Named tasks sharing one cancellation token.
pub struct TaskGroup {
    tasks: JoinSet<(&'static str, anyhow::Result<()>)>,
    shutdown: CancellationToken,
}

impl std::fmt::Debug for TaskGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskGroup").field("tasks", &self.tasks.len()).finish()
    }
}

impl TaskGroup {
    /// An empty group stopped by `shutdown`.
    pub fn new(shutdown: CancellationToken) -> Self {
        Self { tasks: JoinSet::new(), shutdown }
    }

    /// The group's shutdown token (cancel it to stop every task).
    pub fn token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Cancels the group's token on SIGINT (Ctrl-C) or SIGTERM (an orchestrator's stop), so [`Self::wait`]
    /// drains every task: the HTTP server finishes its requests, consumers leave their groups, the relay
    /// finishes its round.
    pub fn stop_on_signal(&mut self) {
        let token = self.shutdown.clone();
        self.spawn("signals", async move {
            #[cfg(unix)]
            let term = async {
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(mut s) => {
                        s.recv().await;
                    }
                    Err(_) => std::future::pending::<()>().await,
                }
            };
            #[cfg(not(unix))]
            let term = std::future::pending::<()>();
            tokio::select! {
                _ = token.cancelled() => return Ok(()),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received, shutting down"),
                _ = term => tracing::info!("SIGTERM received, shutting down"),
            }
            token.cancel();
            Ok(())
        });
    }

    /// Runs `task` as `name`: it should end when the token is cancelled; ending earlier, or failing, stops
    /// the others.
    pub fn spawn<F>(&mut self, name: &'static str, task: F)
    where
        F: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        self.tasks.spawn(async move { (name, task.await) });
    }

    /// Waits for every task. The first failure (or early exit) cancels the others; once cancelled, the
    /// others get `drain` to finish before they are aborted.
    pub async fn wait(mut self, drain: Duration) -> anyhow::Result<()> {
        let mut first_error: Option<anyhow::Error> = None;
        loop {
            let next = if self.shutdown.is_cancelled() {
                match tokio::time::timeout(drain, self.tasks.join_next()).await {
                    Ok(n) => n,
                    Err(_) => {
                        tracing::error!(
                            remaining = self.tasks.len(),
                            "tasks did not stop within the drain timeout; aborting them"
                        );
                        self.tasks.abort_all();
                        first_error.get_or_insert_with(|| anyhow::anyhow!("shutdown timed out"));
                        break;
                    }
                }
            } else {
                self.tasks.join_next().await
            };
            let Some(joined) = next else { break };
            let (name, result) = match joined {
                Ok(r) => r,
                Err(e) => ("task", Err(anyhow::anyhow!("task panicked or was aborted: {e}"))),
            };
            match result {
                Ok(()) if self.shutdown.is_cancelled() => tracing::info!(task = name, "stopped"),
                Ok(()) => {
                    tracing::error!(task = name, "stopped unexpectedly; shutting down");
                    first_error.get_or_insert_with(|| anyhow::anyhow!("{name} stopped unexpectedly"));
                    self.shutdown.cancel();
                }
                Err(e) => {
                    tracing::error!(task = name, error = format!("{e:#}"), "failed; shutting down");
                    first_error.get_or_insert(e.context(name));
                    self.shutdown.cancel();
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failing_task_cancels_the_others_and_fails_the_group() {
        let token = CancellationToken::new();
        let mut group = TaskGroup::new(token.clone());
        let t = token.clone();
        group.spawn("waiter", async move {
            t.cancelled().await;
            Ok(())
        });
        group.spawn("failer", async { Err(anyhow::anyhow!("boom")) });
        let err = group.wait(Duration::from_secs(5)).await.expect_err("the group fails");
        assert!(format!("{err:#}").contains("boom"));
        assert!(token.is_cancelled());
    }

    #[tokio::test]
    async fn graceful_shutdown_is_ok_and_stragglers_are_aborted() {
        let token = CancellationToken::new();
        let mut group = TaskGroup::new(token.clone());
        let t = token.clone();
        group.spawn("polite", async move {
            t.cancelled().await;
            Ok(())
        });
        token.cancel();
        assert!(group.wait(Duration::from_secs(5)).await.is_ok());

        let token = CancellationToken::new();
        let mut group = TaskGroup::new(token.clone());
        group.spawn("stubborn", std::future::pending());
        token.cancel();
        assert!(group.wait(Duration::from_millis(50)).await.is_err());
    }
}

#[cfg(all(test, unix))]
mod signal_tests {
    use super::*;

    /// SIGTERM cancels the group's token: a task waiting for it ends, and the group ends cleanly.
    #[tokio::test]
    async fn sigterm_drains_the_group() {
        let mut group = TaskGroup::new(CancellationToken::new());
        group.stop_on_signal();
        let token = group.token();
        let drained = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = drained.clone();
        group.spawn("worker", async move {
            token.cancelled().await;
            seen.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        });
        tokio::time::sleep(Duration::from_millis(200)).await; // the handler is installed
        let sent = std::process::Command::new("kill").args(["-TERM", &std::process::id().to_string()]).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -TERM");
        let ended = tokio::time::timeout(Duration::from_secs(5), group.wait(Duration::from_secs(2))).await;
        assert!(matches!(ended, Ok(Ok(()))), "{ended:?}");
        assert!(drained.load(std::sync::atomic::Ordering::SeqCst), "the worker saw the cancellation");
    }
}
