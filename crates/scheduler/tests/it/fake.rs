//! A fake engine: KV is a list of tokens per sequence, and the "model" picks
//! the next token as a hash of everything before it, so outputs depend only on
//! content — preemption, batching or recomputation must not change them.

use std::collections::HashMap;

use siliceo_core::{RequestId, TokenId};
use siliceo_kv_paging::{BlockId, BlockOp};
use siliceo_scheduler::{ItemKind, PreemptMode, Preempted, Request, Scheduler, Step};

pub fn prompt(id: &str, len: usize) -> Vec<TokenId> {
    let seed = id
        .bytes()
        .fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
    (0..len as u32)
        .map(|i| TokenId(seed.wrapping_add(i.wrapping_mul(2_654_435_761)) % 5000))
        .collect()
}

fn next_token(context: &[TokenId]) -> TokenId {
    let h = context.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, t| {
        (h ^ u64::from(t.0)).wrapping_mul(0x1000_0000_01b3)
    });
    TokenId((h % 5000) as u32)
}

/// What one request generates when it runs alone to its length limit.
pub fn solo(r: &Request) -> Vec<TokenId> {
    let mut ctx = r.prompt.clone();
    let mut out = Vec::new();
    for _ in 0..r.max_new_tokens {
        let t = next_token(&ctx);
        out.push(t);
        ctx.push(t);
    }
    out
}

#[derive(Debug, Default)]
pub struct FakeEngine {
    /// KV of running sequences: the tokens computed so far.
    kv: HashMap<RequestId, Vec<TokenId>>,
    /// KV saved to "host memory" by swap preemptions.
    swapped: HashMap<RequestId, Vec<TokenId>>,
    outputs: HashMap<RequestId, Vec<TokenId>>,
    /// What each block's KV holds, as computed (the engine's cells): a prefix
    /// hit must land on blocks whose KV really was computed.
    blocks: HashMap<BlockId, Vec<TokenId>>,
    /// The same for the windowed group's blocks, when there is one.
    windowed_blocks: HashMap<BlockId, Vec<TokenId>>,
    pub preemptions: Vec<Preempted>,
    /// Drafted tokens proposed and accepted (speculative items).
    pub drafted: usize,
    pub accepted: usize,
}

impl FakeEngine {
    pub fn output(&self, id: &RequestId) -> Vec<TokenId> {
        self.outputs.get(id).cloned().unwrap_or_default()
    }

    /// The runtime's part of a cancel: drop the sequence's KV.
    pub fn forget(&mut self, id: &RequestId) {
        self.kv.remove(id);
        self.swapped.remove(id);
    }

    /// The cells of a group.
    fn cells(&mut self, windowed: bool) -> &mut HashMap<BlockId, Vec<TokenId>> {
        if windowed {
            &mut self.windowed_blocks
        } else {
            &mut self.blocks
        }
    }

    /// Writes rows `from..kv.len()` into `table`'s blocks of a group (sealed
    /// ones hold their whole block).
    fn write(&mut self, windowed: bool, table: &[BlockId], kv: &[TokenId], from: usize, bs: usize) {
        for i in from / bs..kv.len().div_ceil(bs) {
            let end = kv.len().min((i + 1) * bs);
            assert_ne!(table[i], BlockId::NONE, "a write into a released block");
            self.cells(windowed)
                .insert(table[i], kv[i * bs..end].to_vec());
        }
    }

    /// Runs one planned step the way a real engine must, asserting positions.
    pub fn apply(&mut self, s: &mut Scheduler, step: &Step) {
        for f in &step.finished {
            self.forget(&f.id);
        }
        for b in &step.evicted {
            self.blocks.remove(b);
        }
        let bs = s.kv().config().block_size as usize;
        // The groups, and the windowed layers' window.
        let window = s
            .kv()
            .windowed()
            .and_then(|w| w.config().window)
            .map(|w| w.tokens as usize);
        let groups: &[bool] = if window.is_some() {
            &[false, true]
        } else {
            &[false]
        };
        let table_of = |s: &Scheduler, h, windowed: bool| -> Vec<BlockId> {
            if windowed {
                s.kv().window_table(h).expect("a windowed group").to_vec()
            } else {
                s.kv().block_table(h).to_vec()
            }
        };
        for p in &step.preempted {
            let kv = self
                .kv
                .remove(&p.id)
                .expect("preempted sequence was running");
            assert_eq!(
                kv.len(),
                p.tokens,
                "{}: preempted with {} tokens of KV, scheduler says {}",
                p.id,
                kv.len(),
                p.tokens
            );
            if p.mode == PreemptMode::Swap {
                self.swapped.insert(p.id.clone(), kv);
            }
            self.preemptions.push(p.clone());
        }
        let mut sampled = Vec::new();
        let mut spec = Vec::new();
        for item in &step.items {
            if item.kind == ItemKind::ResumeSwap {
                let kv = self
                    .swapped
                    .remove(&item.id)
                    .expect("swapped KV to restore");
                assert_eq!(s.kv().num_tokens(item.handle), kv.len());
                // The runtime restores the saved rows into the new blocks.
                let table = s.kv().block_table(item.handle);
                for (i, rows) in kv.chunks(bs).enumerate() {
                    self.blocks.insert(table[i], rows.to_vec());
                }
                self.kv.insert(item.id.clone(), kv);
                continue;
            }
            let fresh = self.kv.entry(item.id.clone()).or_default().is_empty();
            let seq_tokens = s.kv().tokens(item.handle);
            // Block work first, as a real store does it: copies, then seals of
            // cached forms must find their rows already there.
            for op in &item.ops {
                match *op {
                    BlockOp::Copy(c) => {
                        let rows = self.cells(c.windowed).get(&c.src).cloned().unwrap_or_else(|| {
                            panic!(
                                "{}: copy {c:?} of a block never written (item at {}, kind {:?}, table {:?})",
                                item.id,
                                item.start_pos,
                                item.kind,
                                s.kv().block_table(item.handle)
                            )
                        });
                        assert!(rows.len() >= c.tokens, "copy of rows never written");
                        let rows = rows[..c.tokens].to_vec();
                        self.cells(c.windowed).insert(c.dst, rows);
                    }
                    BlockOp::Seal(seal) if !seal.encode => {
                        let want = &seq_tokens[seal.index * bs..(seal.index + 1) * bs];
                        assert_eq!(
                            self.cells(seal.windowed).get(&seal.dst).map(Vec::as_slice),
                            Some(want),
                            "{}: a cached sealed block that does not hold block {}",
                            item.id,
                            seal.index
                        );
                    }
                    BlockOp::Seal(_) => {}
                }
            }
            if let ItemKind::Prefill { cached_tokens } = item.kind
                && fresh
                && item.start_pos > 0
            {
                // Prefix served from the cache: its blocks must hold its rows
                // (in the windowed group, those its window has not passed).
                assert!(cached_tokens == 0 || cached_tokens == item.start_pos);
                let want = &seq_tokens[..item.start_pos];
                for &windowed in groups {
                    let table = table_of(s, item.handle, windowed);
                    for (i, chunk) in want.chunks(bs).enumerate() {
                        if table[i] == BlockId::NONE {
                            assert!(windowed, "{}: a global table with a hole", item.id);
                            continue;
                        }
                        // A block this step seals is read from its open source.
                        let src = item.ops.iter().find_map(|op| match op {
                            BlockOp::Seal(seal) if seal.index == i && seal.windowed == windowed => {
                                seal.src
                            }
                            _ => None,
                        });
                        let b = src.unwrap_or(table[i]);
                        let have = self.cells(windowed).get(&b).map(Vec::as_slice);
                        assert!(
                            have.is_some_and(|h| h.starts_with(chunk)),
                            "{}: prefix hit on block {b:?} (windowed {windowed}) holding {have:?}, not {chunk:?}",
                            item.id,
                        );
                    }
                }
                self.kv
                    .get_mut(&item.id)
                    .expect("entry above")
                    .extend_from_slice(want);
            }
            let kv = self.kv.get_mut(&item.id).expect("entry above");
            assert_eq!(
                item.start_pos,
                kv.len(),
                "{}: computing from {} with {} cached",
                item.id,
                item.start_pos,
                kv.len()
            );
            kv.extend_from_slice(&item.tokens);
            let kv = kv.clone();
            // The step writes rows from `start_pos` on, into the blocks the
            // tables have for them now (sealed ones hold the whole block), and
            // quantizes what it seals.
            for &windowed in groups {
                let table = table_of(s, item.handle, windowed);
                self.write(windowed, &table, &kv, item.start_pos, bs);
            }
            for op in &item.ops {
                if let BlockOp::Seal(seal) = op
                    && seal.encode
                {
                    let rows = kv[seal.index * bs..(seal.index + 1) * bs].to_vec();
                    self.cells(seal.windowed).insert(seal.dst, rows);
                }
            }
            // The windowed layers' first query reads the window before it:
            // those blocks are in the table, holding those rows.
            if let Some(w) = window
                && !item.tokens.is_empty()
            {
                let p = item.start_pos;
                let table = table_of(s, item.handle, true);
                for i in (p + 1).saturating_sub(w) / bs..=p / bs {
                    let end = kv.len().min((i + 1) * bs);
                    let have = self.windowed_blocks.get(&table[i]).map(Vec::as_slice);
                    assert!(
                        table[i] != BlockId::NONE
                            && have.is_some_and(|h| h.starts_with(&kv[i * bs..end])),
                        "{}: the query at {p} reads windowed block {i} ({:?}) holding {have:?}",
                        item.id,
                        table[i]
                    );
                }
            }
            let kv = self.kv.get_mut(&item.id).expect("entry above");
            if item.wants_logits && item.draft_slots > 0 {
                // Draft the true continuation for half the slots, then a wrong
                // token; verify greedily like the runtime: keep the agreeing
                // prefix (its KV stays), then the model's own token.
                let mut ctx = kv.clone();
                let mut draft = Vec::new();
                for i in 0..item.draft_slots {
                    let t = next_token(&ctx);
                    let d = if i < item.draft_slots.div_ceil(2) {
                        t
                    } else {
                        TokenId(t.0 ^ 1)
                    };
                    draft.push(d);
                    ctx.push(d);
                }
                let mut accepted = Vec::new();
                let next = loop {
                    let t = next_token(kv);
                    match draft.get(accepted.len()) {
                        Some(&d) if d == t => {
                            accepted.push(d);
                            kv.push(d);
                        }
                        _ => break t,
                    }
                };
                // Drafted tokens' rows were written by the step too.
                let kv = kv.clone();
                for &windowed in groups {
                    let table = table_of(s, item.handle, windowed);
                    self.write(windowed, &table, &kv, item.start_pos, bs);
                }
                self.drafted += draft.len();
                self.accepted += accepted.len();
                spec.push((item.id.clone(), accepted, next));
            } else if item.wants_logits {
                sampled.push((item.id.clone(), next_token(kv)));
            }
        }
        for (id, t) in sampled {
            self.outputs.entry(id.clone()).or_default().push(t);
            if s.on_token(&id, t).is_some() {
                self.forget(&id);
            }
        }
        for (id, accepted, next) in spec {
            let out = self.outputs.entry(id.clone()).or_default();
            out.extend_from_slice(&accepted);
            out.push(next);
            if s.on_tokens(&id, &accepted, next).is_some() {
                self.forget(&id);
            }
        }
    }

    /// Steps until the scheduler is idle.
    pub fn run(&mut self, s: &mut Scheduler, now_ms: u64, max_steps: usize) {
        for _ in 0..max_steps {
            if s.is_idle() {
                return;
            }
            let step = s.schedule(now_ms);
            self.apply(s, &step);
            s.check().unwrap();
        }
        panic!("not idle after {max_steps} steps");
    }
}
