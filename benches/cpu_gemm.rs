//! The CPU GEMM implementations on Llama2-7B's fused QKV projection (N = 12288, K = 4096) at a
//! decode-like M = 1, a small batch M = 8 and a prefill-like M = 64.
//!
//!     cargo bench --bench cpu_gemm               # everything
//!     cargo bench --bench cpu_gemm -- 'M=1/'     # one M (criterion's name filter)
//!
//! W is 96 MiB in f16, well past any LLC, so every run streams W from memory as in decoding.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::Backend;
use fdpp::dtype::{random_bits, DType};
use fdpp::ops::gemm::GemmDims;

const N: usize = 12288;
const K: usize = 4096;

fn qkv(c: &mut Criterion) {
    let b = CpuBackend::new();
    for (dt, ms) in [(DType::F16, &[1usize, 8, 64][..]), (DType::Bf16, &[1][..])] {
        let max_m = ms.iter().copied().max().unwrap_or(1);
        let x = b
            .upload(dt, &random_bits(dt, max_m * K, 1.0 / (K as f32).sqrt(), 1))
            .expect("upload x");
        let w = b.upload(dt, &random_bits(dt, N * K, 1.0, 2)).expect("upload w");
        let mut y = b.alloc(dt, max_m * N).expect("alloc y");
        for &m in ms {
            let dims = GemmDims::new(m, N, K).expect("nonzero dims");
            let mut g = c.benchmark_group(format!("qkv_{dt}/M={m}"));
            g.sample_size(10)
                .warm_up_time(Duration::from_millis(500))
                .measurement_time(Duration::from_secs(2))
                .throughput(Throughput::Bytes(dims.min_bytes() as u64));
            for spec in b.gemm_candidates(dt, N, K) {
                g.bench_function(BenchmarkId::from_parameter(spec.uri()), |bench| {
                    bench.iter(|| b.gemm(&spec, dims, &x, &w, &mut y).expect("gemm"))
                });
            }
            g.finish();
        }
    }
}

criterion_group!(benches, qkv);
criterion_main!(benches);
