//! Block pool and prefix-cache throughput: `cargo bench -p siliceo-kv-paging`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use siliceo_core::TokenId;
use siliceo_kv_paging::block::hash_block;
use siliceo_kv_paging::{BlockHash, BlockPool, CacheKeys, KvCacheManager, KvConfig};

fn pool_ops(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    g.throughput(Throughput::Elements(64));
    g.bench_function("allocate+release 64 blocks", |b| {
        let mut pool = BlockPool::new(4096, 64);
        let mut ids = Vec::with_capacity(64);
        b.iter(|| {
            ids.clear();
            for _ in 0..64 {
                ids.push(pool.allocate().unwrap());
            }
            pool.release_chain(&ids);
        })
    });
    g.finish();

    let mut g = c.benchmark_group("hash");
    let tokens: Vec<TokenId> = (0..64).map(|i| TokenId(i * 7919 % 49152)).collect();
    g.throughput(Throughput::Elements(64));
    g.bench_function("hash one 64-token block", |b| {
        b.iter(|| hash_block(std::hint::black_box(BlockHash(1)), &tokens))
    });
    g.finish();

    let mut g = c.benchmark_group("prefix");
    let prompt: Vec<TokenId> = (0..2048u32).map(|i| TokenId(i * 31 % 49152)).collect();
    let keys = CacheKeys::new("m", "f16");
    let mut kv = KvCacheManager::new(KvConfig {
        num_blocks: 4096,
        block_size: 64,
        ..KvConfig::default()
    });
    let warm = kv.new_sequence(&keys);
    kv.append(warm, &prompt).unwrap();
    g.throughput(Throughput::Elements(prompt.len() as u64));
    g.bench_function("match 2048-token cached prefix + free", |b| {
        b.iter(|| {
            let h = kv.new_sequence(&keys);
            let (n, _) = kv.match_prefix(h, &prompt);
            assert_eq!(n, 1984);
            kv.free(h);
        })
    });
    g.bench_function(
        "admit 2048-token prompt cold (append, register) + free",
        |b| {
            let mut cold = KvCacheManager::new(KvConfig {
                num_blocks: 4096,
                block_size: 64,
                ..KvConfig::default()
            });
            let mut salt = 0u64;
            b.iter(|| {
                salt += 1;
                let h = cold.new_sequence(&keys.clone().with_salt(salt.to_string()));
                cold.match_prefix(h, &prompt);
                cold.append(h, &prompt).unwrap();
                cold.free(h);
            })
        },
    );
    g.finish();
}

criterion_group!(benches, pool_ops);
criterion_main!(benches);
