//! The prefix cache's events, for a gateway that routes each request to the
//! replica holding its prefix (SMG's cache_aware policy subscribes to them
//! over gRPC).
//!
//! The engine thread publishes, after every step, the full blocks the cache
//! gained and lost ([`siliceo_kv_paging::KvEvent`], one per content) as a
//! numbered [`EventBatch`]. The hub keeps the recent batches, so a subscriber
//! that lost its stream resumes after the last batch it applied, and the
//! blocks live now, so a new subscriber starts from a snapshot of them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use siliceo_kv_paging::{BlockHash, KvEvent};
use tokio::sync::broadcast;

/// Batches kept for subscribers that resume.
const HISTORY: usize = 4096;

/// One change to the cached blocks, as subscribers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block's content became cached.
    Stored {
        /// Its content hash (an identity: parents point at it, removals name it).
        hash: u64,
        /// The block before it; `None` for a sequence's first block.
        parent: Option<u64>,
        /// Its tokens (shared with the hub's live set).
        tokens: Arc<[u32]>,
    },
    /// No block holds this content any more.
    Removed {
        /// The hash a `Stored` event announced.
        hash: u64,
    },
    /// Everything cached is gone (the engine reset its cache).
    Cleared,
}

/// Events published together, numbered from 1 without gaps.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Sequence number.
    pub seq: u64,
    /// Seconds since the Unix epoch when it was published.
    pub timestamp: f64,
    /// The changes, in order.
    pub events: Vec<CacheEvent>,
}

/// A subscriber's start: what it missed, then the live feed.
#[derive(Debug)]
pub struct Subscription {
    /// Batches to send first (a snapshot, or the history after the
    /// subscriber's last batch), in order.
    pub backlog: Vec<Arc<EventBatch>>,
    /// Batches published from now on (a receiver that falls more than the
    /// channel's capacity behind gets `Lagged`; its subscriber then resumes).
    pub live: broadcast::Receiver<Arc<EventBatch>>,
    /// The last sequence number published when it subscribed.
    pub last_seq: u64,
}

/// A resume point the hub cannot serve: the batches after it are no longer
/// kept, or were never published (the engine restarted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot resume after batch {asked}: this server's batches run {oldest}..={last}; \
     subscribe from 0 for a snapshot"
)]
pub struct OutOfRange {
    /// The sequence number asked for.
    pub asked: u64,
    /// The oldest batch kept.
    pub oldest: u64,
    /// The last batch published.
    pub last: u64,
}

#[derive(Debug)]
struct Live {
    parent: Option<u64>,
    tokens: Arc<[u32]>,
    /// Blocks before it in its chain as known when stored (snapshot order).
    depth: u32,
}

#[derive(Debug, Default)]
struct HubState {
    seq: u64,
    history: VecDeque<Arc<EventBatch>>,
    live: HashMap<u64, Live>,
}

/// Publishes the cache's events and serves subscribers.
#[derive(Debug)]
pub struct KvEventHub {
    state: Mutex<HubState>,
    tx: broadcast::Sender<Arc<EventBatch>>,
}

impl Default for KvEventHub {
    fn default() -> Self {
        KvEventHub::new()
    }
}

impl KvEventHub {
    /// A hub with nothing published.
    pub fn new() -> Self {
        KvEventHub {
            state: Mutex::new(HubState::default()),
            tx: broadcast::channel(HISTORY).0,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes the cache's changes as one batch (nothing when empty).
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let events = events
            .into_iter()
            .map(|e| match e {
                KvEvent::Stored {
                    hash,
                    parent,
                    tokens,
                } => CacheEvent::Stored {
                    hash: hash.0,
                    parent: parent.map(|p: BlockHash| p.0),
                    tokens: tokens.iter().map(|t| t.0).collect(),
                },
                KvEvent::Removed { hash } => CacheEvent::Removed { hash: hash.0 },
            })
            .collect();
        self.send(events);
    }

    /// Announces that everything cached is gone.
    pub fn clear(&self) {
        self.send(vec![CacheEvent::Cleared]);
    }

    fn send(&self, events: Vec<CacheEvent>) {
        let mut st = self.lock();
        for e in &events {
            match e {
                CacheEvent::Stored {
                    hash,
                    parent,
                    tokens,
                } => {
                    let depth = parent
                        .and_then(|p| st.live.get(&p))
                        .map_or(0, |p| p.depth + 1);
                    st.live.insert(
                        *hash,
                        Live {
                            parent: *parent,
                            tokens: tokens.clone(),
                            depth,
                        },
                    );
                }
                CacheEvent::Removed { hash } => {
                    st.live.remove(hash);
                }
                CacheEvent::Cleared => st.live.clear(),
            }
        }
        st.seq += 1;
        let batch = Arc::new(EventBatch {
            seq: st.seq,
            timestamp: siliceo_core::unix_time_s(),
            events,
        });
        if st.history.len() == HISTORY {
            st.history.pop_front();
        }
        st.history.push_back(batch.clone());
        // No receiver is not an error: nobody subscribes to a lone server.
        let _ = self.tx.send(batch);
    }

    /// Full blocks cached now, as the published events say.
    pub fn live_blocks(&self) -> usize {
        self.lock().live.len()
    }

    /// Subscribes after batch `after`: 0 for a snapshot of the blocks cached
    /// now (one batch numbered as the last one published: a clear, then every
    /// block, parents first), else the kept batches after it.
    pub fn subscribe(&self, after: u64) -> Result<Subscription, OutOfRange> {
        let st = self.lock();
        let live = self.tx.subscribe();
        let backlog = if after == 0 {
            if st.seq == 0 {
                Vec::new()
            } else {
                let mut blocks: Vec<(&u64, &Live)> = st.live.iter().collect();
                blocks.sort_by_key(|(h, l)| (l.depth, **h));
                let mut events = vec![CacheEvent::Cleared];
                events.extend(blocks.into_iter().map(|(h, l)| CacheEvent::Stored {
                    hash: *h,
                    parent: l.parent,
                    tokens: l.tokens.clone(),
                }));
                vec![Arc::new(EventBatch {
                    seq: st.seq,
                    timestamp: siliceo_core::unix_time_s(),
                    events,
                })]
            }
        } else {
            let oldest = st.history.front().map_or(st.seq + 1, |b| b.seq);
            if after > st.seq || after + 1 < oldest {
                return Err(OutOfRange {
                    asked: after,
                    oldest,
                    last: st.seq,
                });
            }
            st.history
                .iter()
                .filter(|b| b.seq > after)
                .cloned()
                .collect()
        };
        Ok(Subscription {
            backlog,
            live,
            last_seq: st.seq,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use siliceo_core::TokenId;

    fn stored(h: u64, parent: Option<u64>) -> KvEvent {
        KvEvent::Stored {
            hash: BlockHash(h),
            parent: parent.map(BlockHash),
            tokens: vec![TokenId(h as u32); 4],
        }
    }

    #[test]
    fn snapshots_resumes_and_refuses_what_it_cannot_replay() {
        let hub = KvEventHub::new();
        assert!(hub.subscribe(0).unwrap().backlog.is_empty());
        hub.publish(vec![stored(1, None), stored(2, Some(1))]);
        hub.publish(vec![
            stored(3, Some(2)),
            KvEvent::Removed { hash: BlockHash(1) },
        ]);
        hub.publish(Vec::new());
        assert_eq!(hub.live_blocks(), 2);

        // A snapshot: numbered as the last batch, a clear then the live blocks.
        let s = hub.subscribe(0).unwrap();
        assert_eq!(s.last_seq, 2);
        assert_eq!(s.backlog.len(), 1);
        assert_eq!(s.backlog[0].seq, 2);
        let hashes: Vec<Option<u64>> = s.backlog[0]
            .events
            .iter()
            .map(|e| match e {
                CacheEvent::Stored { hash, .. } => Some(*hash),
                _ => None,
            })
            .collect();
        assert_eq!(hashes, [None, Some(2), Some(3)]);

        // A resume replays what follows; the live feed carries what comes next.
        let mut r = hub.subscribe(1).unwrap();
        assert_eq!(r.backlog.iter().map(|b| b.seq).collect::<Vec<_>>(), [2]);
        assert!(hub.subscribe(2).unwrap().backlog.is_empty());
        hub.clear();
        let next = r.live.try_recv().unwrap();
        assert_eq!(
            (next.seq, next.events.clone()),
            (3, vec![CacheEvent::Cleared])
        );
        assert_eq!(hub.live_blocks(), 0);

        // Ahead of the publisher (it restarted): out of range.
        let e = hub.subscribe(9).unwrap_err();
        assert_eq!((e.asked, e.oldest, e.last), (9, 1, 3));
    }
}
