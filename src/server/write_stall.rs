//! Sender connections whose writes must make progress. hyper's HTTP/1
//! server has no write timeout: once a sender stops reading, its socket
//! fills, hyper stops polling the response body, and the upstream connection
//! that body comes on, with the application's worker writing to it, is held
//! for as long as the sender keeps its connection open, outside
//! `limits.max_concurrent_requests` (a request's place there is given back
//! once its answer is made, before the body is passed on). A
//! write the socket has taken nothing of for the stall limit fails instead,
//! which ends the connection and drops what it was passing on. (HTTP/2
//! senders that stop taking one stream's response, the connection still
//! read, are `sender_stall`'s.)

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `io`, whose writes fail once the peer has taken nothing for `stall`.
pub(super) struct StalledWrites<T> {
    io: T,
    stall: Duration,
    // Made on the first write the peer's socket refuses: a connection whose
    // peer keeps reading (nearly every one) costs no timer.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<T> StalledWrites<T> {
    pub(super) fn new(io: T, stall: Duration) -> Self {
        Self {
            io,
            stall,
            timer: None,
        }
    }

    /// Passes on a write's result, failing it once writes have waited for
    /// `stall` without progress.
    fn fail_if_stalled<R>(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if written.is_ready() {
            self.timer = None;
            return written;
        }
        let stall = self.stall;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the sender took nothing for {stall:?}"),
        )))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StalledWrites<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StalledWrites<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write(cx, buf);
        self.fail_if_stalled(cx, written)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.fail_if_stalled(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = Pin::new(&mut self.io).poll_flush(cx);
        self.fail_if_stalled(cx, flushed)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const STALL: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn a_write_the_peer_takes_nothing_of_fails_after_the_stall() {
        let (near, _far) = tokio::io::duplex(16);
        let mut io = StalledWrites::new(near, STALL);
        io.write_all(&[0; 16]).await.unwrap();
        let started = tokio::time::Instant::now();
        let error = io.write_all(b"more").await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), STALL);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_keeps_taking_resets_the_stall() {
        let (near, mut far) = tokio::io::duplex(16);
        let mut io = StalledWrites::new(near, STALL);
        let reader = tokio::spawn(async move {
            let mut taken = Vec::new();
            let mut buffer = [0; 16];
            while taken.len() < 64 {
                // Each read comes just inside the stall.
                tokio::time::sleep(STALL - Duration::from_secs(1)).await;
                let read = far.read(&mut buffer).await.unwrap();
                taken.extend_from_slice(&buffer[..read]);
            }
            taken
        });
        io.write_all(&[7; 64]).await.unwrap();
        assert_eq!(reader.await.unwrap(), [7; 64]);
    }
}
