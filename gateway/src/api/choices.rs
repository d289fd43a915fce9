//! A request's choices (`n`): their worker streams merged into one, each
//! event tagged with its choice's index, in the order they come.

use std::collections::VecDeque;

use futures::StreamExt;
use futures::stream::{BoxStream, SelectAll};

use super::worker::Started;
use super::*;

type Tagged = (usize, Result<Option<WorkerEvent>, UpstreamError>);

/// The running choices of one request.
pub(super) struct Choices {
    /// Choice 0's acceptance: the prompt's tokens and the adapter's place.
    pub(super) accepted: upstream::Accepted,
    /// Each choice's first event, read while it started.
    first: VecDeque<(usize, WorkerEvent)>,
    streams: SelectAll<BoxStream<'static, Tagged>>,
    finished: Vec<bool>,
    /// Held to the end: the worker counts these requests as in flight.
    _in_flight: Vec<crate::router::fleet::InFlight>,
}

/// How a choice's stream ended early.
pub(super) enum Ended {
    Worker(UpstreamError),
    /// A worker closed a choice's stream before its `Finished` event.
    Closed,
}

impl Choices {
    /// Choice 0, then the others in index order.
    pub(super) fn new(started: Vec<Started>) -> Choices {
        let accepted = started.first().map(|s| s.accepted).unwrap_or_default();
        let mut first = VecDeque::new();
        let mut streams = SelectAll::new();
        let mut in_flight = Vec::new();
        let n = started.len();
        for (i, s) in started.into_iter().enumerate() {
            first.push_back((i, s.first));
            in_flight.push(s._in_flight);
            let events = futures::stream::unfold(Some(s.stream), move |state| async move {
                let mut events = state?;
                let next = events.next().await;
                let more = matches!(next, Ok(Some(_)));
                Some(((i, next), more.then_some(events)))
            });
            streams.push(events.boxed());
        }
        Choices {
            accepted,
            first,
            streams,
            finished: vec![false; n],
            _in_flight: in_flight,
        }
    }

    /// How many choices there are.
    pub(super) fn len(&self) -> usize {
        self.finished.len()
    }

    /// The next event of any choice. A stream that closes after its
    /// choice's `Finished` is passed over; one that closes before is
    /// [`Ended::Closed`].
    pub(super) async fn next(&mut self) -> Result<(usize, WorkerEvent), Ended> {
        loop {
            let (i, next) = match self.first.pop_front() {
                Some((i, e)) => (i, Ok(Some(e))),
                None => self.streams.next().await.ok_or(Ended::Closed)?,
            };
            match next {
                Ok(Some(e)) => {
                    if matches!(e, WorkerEvent::Finished(_)) {
                        self.finished[i] = true;
                    }
                    return Ok((i, e));
                }
                Ok(None) if self.finished[i] => continue,
                Ok(None) => return Err(Ended::Closed),
                Err(e) => return Err(Ended::Worker(e)),
            }
        }
    }
}
