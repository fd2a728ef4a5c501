//! Coalescing of concurrent store calls into multi-row statements. Requests
//! queue; whenever a connection is free, everything queued so far (up to a
//! batch limit) goes out as one statement and one commit. Under light load a
//! batch is one request and nothing waits; under load the database does far
//! more work per round trip and per commit. Owns the queue and the fan-out of
//! results; what a batch means is up to the `run` function it is given.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::StoreError;

/// One queued call.
struct Job<Request, Response> {
    request: Request,
    reply: oneshot::Sender<Result<Response, StoreError>>,
}

/// A handle to a coalescing queue; cheap to clone.
pub struct Coalescer<Request, Response> {
    queue: mpsc::UnboundedSender<Job<Request, Response>>,
}

impl<Request, Response> Clone for Coalescer<Request, Response> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
        }
    }
}

impl<Request, Response> Coalescer<Request, Response>
where
    Request: Send + 'static,
    Response: Send + 'static,
{
    /// Starts the dispatcher. At most `concurrency` batches run at once (one
    /// per connection), each of at most `max_batch` requests. `run` gets the
    /// batch's requests and returns one result per request, in order; a
    /// batch that fails as a whole fails its own requests and no other.
    pub fn start<Run, Fut>(concurrency: usize, max_batch: usize, run: Run) -> Self
    where
        Run: Fn(Vec<Request>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Result<Response, StoreError>>> + Send + 'static,
    {
        let (queue, jobs) = mpsc::unbounded_channel();
        tokio::spawn(dispatch(jobs, concurrency.max(1), max_batch.max(1), run));
        Self { queue }
    }

    /// Queues a request and waits for its result.
    pub async fn call(&self, request: Request) -> Result<Response, StoreError> {
        self.enqueue(request)?.await.map_err(|_| stopped())?
    }

    /// Queues a request; its result arrives on the receiver, and the request
    /// is run even if the receiver is dropped first.
    pub fn enqueue(
        &self,
        request: Request,
    ) -> Result<oneshot::Receiver<Result<Response, StoreError>>, StoreError> {
        let (reply, response) = oneshot::channel();
        self.queue
            .send(Job { request, reply })
            .map_err(|_| stopped())?;
        Ok(response)
    }
}

pub(super) fn stopped() -> StoreError {
    StoreError::Postgres("the store's dispatcher has stopped".into())
}

async fn dispatch<Request, Response, Run, Fut>(
    mut jobs: mpsc::UnboundedReceiver<Job<Request, Response>>,
    concurrency: usize,
    max_batch: usize,
    run: Run,
) where
    Request: Send + 'static,
    Response: Send + 'static,
    Run: Fn(Vec<Request>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<Result<Response, StoreError>>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(concurrency));
    let run = Arc::new(run);
    loop {
        // A free slot first, then everything that queued while none was.
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let Some(first) = jobs.recv().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let run = Arc::clone(&run);
        tokio::spawn(async move {
            let (requests, replies): (Vec<_>, Vec<_>) = batch
                .into_iter()
                .map(|job| (job.request, job.reply))
                .unzip();
            let expected = requests.len();
            let mut results = run(requests).await;
            drop(slot);
            if results.len() != expected {
                let error = StoreError::Postgres(format!(
                    "a batch of {expected} returned {} results",
                    results.len()
                ));
                results = (0..expected).map(|_| Err(error.clone())).collect();
            }
            for (reply, result) in replies.into_iter().zip(results) {
                let _ = reply.send(result);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn results_go_back_in_order_and_batches_grow_under_load() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&sizes);
        let doubler = Coalescer::start(1, 8, move |batch: Vec<u32>| {
            seen.lock().unwrap().push(batch.len());
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                batch.into_iter().map(|n| Ok(n * 2)).collect()
            }
        });
        let calls: Vec<_> = (0..20)
            .map(|n| {
                let doubler = doubler.clone();
                tokio::spawn(async move { (n, doubler.call(n).await.unwrap()) })
            })
            .collect();
        for call in calls {
            let (n, doubled) = call.await.unwrap();
            assert_eq!(doubled, n * 2);
        }
        let sizes = sizes.lock().unwrap();
        assert_eq!(sizes.iter().sum::<usize>(), 20);
        assert!(sizes.iter().all(|&size| size <= 8), "{sizes:?}");
        assert!(
            sizes.len() < 20,
            "concurrent calls were coalesced: {sizes:?}"
        );
    }

    #[tokio::test]
    async fn a_failed_request_fails_alone() {
        let flaky = Coalescer::start(1, 4, |batch: Vec<u32>| async move {
            batch
                .into_iter()
                .map(|n| match n {
                    13 => Err(StoreError::Postgres("unlucky".into())),
                    n => Ok(n),
                })
                .collect()
        });
        let (unlucky, lucky) = tokio::join!(flaky.call(13), flaky.call(7));
        assert!(unlucky.is_err());
        assert_eq!(lucky.unwrap(), 7);
    }

    #[tokio::test]
    async fn a_wrong_number_of_results_is_an_error_not_a_mismatch() {
        let broken = Coalescer::start(1, 4, |_batch: Vec<u32>| async move {
            Vec::<Result<u32, _>>::new()
        });
        assert!(broken.call(1).await.is_err());
    }
}
