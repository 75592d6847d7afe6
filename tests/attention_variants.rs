//! The attention kernel family's variants: serial (one thread walks every key) and split along
//! the keys (partitions of fixed positions, merged in position order; a workgroup per kv head or
//! a thread per query head). Each matches the CPU reference, they agree, and each split one is
//! exact on its own terms: a row's logits never depend on the other rows, the chunking or the
//! token groups, bit for bit, across many partitions. CI also runs the whole suite with each
//! variant forced (`KVDECODE_ATTENTION`, `KVDECODE_PORTABLE=1` for serial).

mod common;

use common::*;
use kvdecode::{AttentionKernel, Engine, EngineOptions, Gpu, GpuOptions, KvDtype, LayerSpec, ModelConfig, SplitMix64};

fn engine(gpu: &Gpu, cfg: &ModelConfig, seed: u64, rows: usize, max_len: usize, kernel: AttentionKernel) -> Engine {
    let w = model(cfg, seed);
    Engine::new(gpu, &w, EngineOptions { attention: kernel, ..EngineOptions::new(rows, max_len) }).unwrap()
}

#[test]
fn variants_resolve_as_asked() {
    let gpu = gpu();
    let auto = match gpu.info.device_type {
        wgpu::DeviceType::Cpu => AttentionKernel::SplitHead,
        _ => AttentionKernel::SplitGroup,
    };
    println!("{}: auto picks {auto:?}", gpu.describe());
    for (asked, built) in [
        (AttentionKernel::Serial, AttentionKernel::Serial),
        (AttentionKernel::SplitGroup, AttentionKernel::SplitGroup),
        (AttentionKernel::SplitHead, AttentionKernel::SplitHead),
        (AttentionKernel::Auto, auto),
    ] {
        assert_eq!(engine(&gpu, &llama_cfg(), 1, 1, 64, asked).attention_kernel(), built, "asked {asked:?}");
    }
    // 32 query heads on one kv head: more than split-group's 16 per kv head
    let wide = ModelConfig::llama(96, 32, 32, 1, 8, 48, 2, 10000.0, 1e-6, false);
    let w = model(&wide, 2);
    if auto == AttentionKernel::SplitGroup {
        let e = Engine::new(&gpu, &w, EngineOptions { attention: AttentionKernel::Auto, ..EngineOptions::new(1, 64) });
        assert_eq!(e.unwrap().attention_kernel(), AttentionKernel::Serial, "auto falls back to serial");
    }
    let opts = EngineOptions { attention: AttentionKernel::SplitGroup, ..EngineOptions::new(1, 64) };
    let err = Engine::new(&gpu, &w, opts).err().expect("split-group cannot take 32 heads per kv head").to_string();
    assert!(err.contains("16 query heads per kv head") && err.contains("32 x 8"), "{err}");
    // split-head can
    let opts = EngineOptions { attention: AttentionKernel::SplitHead, ..EngineOptions::new(1, 64) };
    let mut e = Engine::new(&gpu, &w, opts).unwrap();
    let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 96).collect();
    let got = e.append(&ids, 40, &[40], None).unwrap();
    assert!(max_abs_diff(got.row(0).unwrap(), &ref_last(&w, &ids)) <= 1e-4);
}

/// Feed `tokens` of each row in random ragged appends; return the logits after each append.
fn ragged_prefill(e: &mut Engine, tokens: &[Vec<u32>], rng: &mut SplitMix64) -> Vec<Vec<Option<Vec<f32>>>> {
    let rows = tokens.len();
    let mut fed = vec![0; rows];
    let mut out = Vec::new();
    while fed.iter().zip(tokens).any(|(f, t)| *f < t.len()) {
        let n_new: Vec<usize> = (0..rows).map(|r| rng.below(90).min(tokens[r].len() - fed[r])).collect();
        let width = n_new.iter().copied().max().unwrap().max(1);
        let mut ids = vec![0u32; rows * width];
        for r in 0..rows {
            ids[r * width..r * width + n_new[r]].copy_from_slice(&tokens[r][fed[r]..fed[r] + n_new[r]]);
            fed[r] += n_new[r];
        }
        let l = e.append(&ids, width, &n_new, None).unwrap();
        out.push((0..rows).map(|r| l.row(r).map(|x| x.to_vec())).collect());
    }
    out
}

#[test]
fn split_and_serial_match_reference_over_many_partitions() {
    let s = seed(31);
    println!("seed {s}");
    let mut rng = SplitMix64(s);
    let cfg = llama_cfg();
    let w = model(&cfg, s);
    let gpu = gpu();
    // 300 positions: partitions of 64, five per query; rows end in different partitions
    let tokens: Vec<Vec<u32>> =
        [260, 133, 64].iter().map(|&n| (0..n).map(|_| rng.below(96) as u32).collect()).collect();
    let mut last = Vec::new();
    for kernel in AttentionKernel::ALL {
        let mut e = Engine::new(&gpu, &w, EngineOptions { attention: kernel, ..EngineOptions::new(3, 300) }).unwrap();
        assert_eq!(e.attention_kernel(), kernel);
        let mut rng = SplitMix64(s ^ 7);
        ragged_prefill(&mut e, &tokens, &mut rng);
        // one decode step each, then compare every row with the reference
        let next: Vec<u32> = (0..3).map(|r| (r * 5 + 1) as u32).collect();
        let l = e.append(&next, 1, &[1, 1, 1], None).unwrap();
        let mut rows = Vec::new();
        for (r, t) in tokens.iter().enumerate() {
            let mut all = t.clone();
            all.push(next[r]);
            let want = ref_last(&w, &all);
            let d = max_abs_diff(l.row(r).unwrap(), &want);
            assert!(d <= 2e-4, "seed {s} {kernel:?} row {r} ({} tokens): {d}", all.len());
            rows.push(l.row(r).unwrap().to_vec());
        }
        last.push(rows);
    }
    for (kernel, rows) in AttentionKernel::ALL.iter().zip(&last).skip(1) {
        for (r, (serial, other)) in last[0].iter().zip(rows).enumerate() {
            let d = max_abs_diff(serial, other);
            assert!(d <= 2e-4, "seed {s} row {r}: serial and {kernel:?} differ by {d}");
        }
    }
}

#[test]
fn split_is_exact_whatever_the_batch_chunking_and_token_groups() {
    for kernel in [AttentionKernel::SplitGroup, AttentionKernel::SplitHead] {
        split_exact(kernel);
    }
}

fn split_exact(kernel: AttentionKernel) {
    let s = seed(32);
    println!("seed {s}");
    let mut rng = SplitMix64(s);
    // layers 0 and 2 global, layer 1 a sliding window of 16 only (its attention runs serial
    // over the ring, per token group, in the same engine)
    let mut cfg = llama_cfg();
    cfg.window = 16;
    cfg.layers[1] = LayerSpec { global_group: None, writes_global: false, local: true };
    cfg.layers[2].global_group = Some(1);
    let target: Vec<u32> = (0..700).map(|_| rng.below(96) as u32).collect();
    // alone, one append (chunks of CHUNK tokens), on a default device; 1100 positions: 18
    // partitions of 64, f16 K/V
    let w = model(&cfg, s);
    let opts = |rows| EngineOptions { kv: KvDtype::F16, attention: kernel, ..EngineOptions::new(rows, 1100) };
    let mut alone = Engine::new(&gpu(), &w, opts(1)).unwrap();
    let want = alone.append(&target, target.len(), &[target.len()], None).unwrap().row(0).unwrap().to_vec();
    // with two other rows, ragged appends, on a device whose 128 KiB bindings force narrow chunks,
    // cache shards (a row's 1100 positions of K/V take 70 KiB) and several token groups per chunk
    // (each its own partials scratch round)
    let small = Gpu::with_options(&GpuOptions { max_storage_binding: Some(128 << 10), ..Default::default() }).unwrap();
    let mut crowd = Engine::new(&small, &w, opts(3)).unwrap();
    assert!(crowd.attention_token_groups() > 1, "one token group: {}", crowd.attention_token_groups());
    assert!(crowd.cache().shard_rows() < 3, "cache not sharded");
    let others: Vec<Vec<u32>> = (0..2).map(|_| (0..780).map(|_| rng.below(96) as u32).collect()).collect();
    let tokens = vec![others[0].clone(), target.clone(), others[1].clone()];
    let outs = ragged_prefill(&mut crowd, &tokens, &mut rng);
    // the target row's logits from the append that fed its last token
    let got = outs.iter().rev().find_map(|o| o[1].clone()).unwrap();
    assert_eq!(crowd.cache().history(1), &target[..]);
    assert!(got == want, "seed {s} {kernel:?}: logits differ from the row alone: {}", max_abs_diff(&got, &want));
}

#[test]
fn query_tiles_give_the_bits_of_one_token_at_a_time() {
    // split-group's 256 lanes spread a tile's keys over the lanes a group's value elements leave
    // in ranges: 2 query heads per kv head of 8 dims, 64 ranges of one key; 3 heads of 64
    // (SmolLM2's group), 5 ranges; 6 heads of 96, 144 elements: one range, keys in order
    let heads_of_64 = ModelConfig::llama(96, 64, 6, 2, 64, 96, 2, 10000.0, 1e-6, false);
    let heads_of_96 = ModelConfig::llama(96, 64, 6, 1, 96, 96, 2, 10000.0, 1e-6, false);
    for (cfg, tile) in [(llama_cfg(), 16), (heads_of_64, 8), (heads_of_96, 2)] {
        for kv in [KvDtype::F32, KvDtype::F16] {
            query_tiles_exact(&cfg, tile, kv);
        }
    }
}

fn query_tiles_exact(cfg: &ModelConfig, tile: usize, kv: KvDtype) {
    let s = seed(34);
    println!("seed {s}, {} heads per kv head of {}, {kv:?}", cfg.n_heads / cfg.n_kv_heads, cfg.head_dim);
    let mut rng = SplitMix64(s);
    let w = model(cfg, s);
    let gpu = gpu();
    let opts = EngineOptions { kv, attention: AttentionKernel::SplitGroup, ..EngineOptions::new(3, 300) };
    // rows that end in different partitions of 64 positions, and mid-tile
    let tokens: Vec<Vec<u32>> =
        [150, 77, 140].iter().map(|&n| (0..n).map(|_| rng.below(96) as u32).collect()).collect();
    // one token a step: `main`, one workgroup per token
    let mut single = Engine::new(&gpu, &w, opts).unwrap();
    let mut want = vec![Vec::new(); 3];
    for i in 0..150 {
        let n_new: Vec<usize> = tokens.iter().map(|t| usize::from(i < t.len())).collect();
        let ids: Vec<u32> = tokens.iter().map(|t| t.get(i).copied().unwrap_or(0)).collect();
        let l = single.append(&ids, 1, &n_new, None).unwrap();
        for (r, t) in tokens.iter().enumerate() {
            if i + 1 == t.len() {
                want[r] = l.row(r).unwrap().to_vec();
            }
        }
    }
    // the whole prompts in one step, then in random ragged chunks: query tiles cut at other tokens
    let mut whole = Engine::new(&gpu, &w, opts).unwrap();
    assert_eq!(whole.attention_query_tile(), tile);
    let mut ids = vec![0u32; 3 * 150];
    for (r, t) in tokens.iter().enumerate() {
        ids[r * 150..r * 150 + t.len()].copy_from_slice(t);
    }
    let l = whole.append(&ids, 150, &[150, 77, 140], None).unwrap();
    let mut ragged = Engine::new(&gpu, &w, opts).unwrap();
    let outs = ragged_prefill(&mut ragged, &tokens, &mut rng);
    for r in 0..3 {
        let got = l.row(r).unwrap();
        assert!(
            got == want[r],
            "seed {s} row {r}: one step differs from one token a step: {}",
            max_abs_diff(got, &want[r])
        );
        let got = outs.iter().rev().find_map(|o| o[r].clone()).unwrap();
        assert!(got == want[r], "seed {s} row {r}: ragged chunks differ: {}", max_abs_diff(&got, &want[r]));
        // f16 K/V rounds every key and value: further from the f32 reference
        let d = max_abs_diff(&got, &ref_last(&w, &tokens[r]));
        assert!(d <= if kv == KvDtype::F32 { 2e-4 } else { 2e-2 }, "seed {s} row {r}: {d} from the reference");
    }
}

#[test]
fn long_contexts_walk_several_tiles_per_partition() {
    // max_len 20000: more than 64 partitions of 64 would be needed, so partitions grow to 512
    // positions (split-group walks eight tiles of 64 in each, split-head 512 keys per thread)
    let s = seed(33);
    println!("seed {s}");
    let mut rng = SplitMix64(s);
    let w = model(&llama_cfg(), s);
    let tokens: Vec<u32> = (0..700).map(|_| rng.below(96) as u32).collect();
    let want = ref_last(&w, &tokens);
    let gpu = gpu();
    for kernel in AttentionKernel::ALL {
        let opts = EngineOptions { attention: kernel, beyond_trained_context: true, ..EngineOptions::new(1, 20_000) };
        let mut e = Engine::new(&gpu, &w, opts).unwrap();
        let got = e.append(&tokens, tokens.len(), &[tokens.len()], None).unwrap();
        let d = max_abs_diff(got.row(0).unwrap(), &want);
        assert!(d <= 2e-4, "seed {s} {kernel:?}: {d}");
    }
}
