//! Mixtures of experts in the engine: a MoE layer's dispatches ([`Builder::moe_mlp`]) and the
//! route log ([`Engine::routes`]).

use crate::engine::builder::{Builder, ProductIo};
use crate::engine::dispatch::{Dispatch, Grid};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::gpu::kernels::{self, Lanes};
use crate::gpu::shaders::Kernel;
use crate::gpu::weights::{GpuLayer, GpuMatrix};
use crate::model::config::{MlpKind, MoeConfig};

/// Tokens whose (token, slot) pairs one workgroup of the expert products walks: in a decode step
/// of up to this many rows, the tokens routed to one expert share its weight reads (once per four
/// of them); larger steps (prefill) spread over more workgroups, a block of tokens each.
pub const EXPERT_TOKEN_BLOCK: usize = 32;

impl Builder<'_> {
    /// A MoE layer's MLP and residual: the block's input written once (the router and every
    /// expert read it), the router's logits (a product like any other, f32 weights), each token's
    /// top-k experts and weights (`moe.wgsl`), then the routed experts' gated MLP in and MLP out,
    /// a row per (token, slot), the tokens on one expert sharing its weight reads
    /// (`matmul_experts.wgsl`), and each token's rows summed by its routes' weights into the
    /// stream.
    pub(super) fn moe_mlp(
        &self,
        out: &mut Vec<Dispatch>,
        moe: &MoeConfig,
        ordinal: usize,
        router: &GpuMatrix,
        lw: &GpuLayer,
    ) {
        let (c, s) = (self.cfg, self.s);
        let h = if c.pre_norms {
            out.push(self.norm(&s.x, lw.mlp_norm.as_ref(), &s.h, false));
            &s.h
        } else {
            &s.x
        };
        out.extend(self.product(router, ProductIo::new(h, c.d_model, &s.router_logits, moe.experts)));
        let slots = kernels::RouteSlots {
            experts: moe.experts,
            top_k: moe.top_k,
            stride: moe.layers.len() * moe.top_k,
            offset: ordinal * moe.top_k,
        };
        let log_max_len = self.route_log.then_some(self.cache.max_len());
        out.push(self.dispatch(
            &kernels::MoeRoute { slots, norm_topk: moe.norm_topk, log_max_len },
            &[&s.step, &s.row_info, &s.router_logits, &s.routes, &s.route_log],
            Grid::Tokens(1),
        ));
        // (GpuWeights::upload refuses a MoE layer whose experts need more than one binding)
        let lanes = Lanes::Threads { outs: self.outs_per_thread, wg: self.product_wg };
        let experts = |w: &GpuMatrix, x_stride: usize, out_rows: usize, out_stride: usize, act: Option<MlpKind>| {
            kernels::Product {
                kernel: Kernel::MatmulExperts,
                k: w.cols,
                x_stride,
                out_rows,
                out_stride,
                out_offset: 0,
                format: w.format,
                accumulate: false,
                softcap: 0.0,
                per_row: false,
                norm: None,
                act,
                bias: w.parts[0].bias.is_some(),
                lanes,
                lora: None,
            }
        };
        let pairs = |product, x_per_slot| kernels::ExpertProduct {
            product,
            slots,
            sum_slots: false,
            x_per_slot,
            token_block: EXPERT_TOKEN_BLOCK,
            shared: false,
        };
        let grid = |out_rows| Grid::ExpertPairs {
            out_rows,
            outs: self.outs_per_thread,
            experts: moe.experts,
            top_k: moe.top_k,
            token_block: EXPERT_TOKEN_BLOCK,
        };
        let dummy = &s.dummy;
        out.push(self.dispatch(
            &pairs(experts(&lw.mlp_in, c.d_model, moe.ffn, moe.ffn, Some(c.mlp)), false),
            &[
                &s.step,
                h,
                &lw.mlp_in.parts[0].buffer,
                &s.expert_act,
                dummy,
                lw.mlp_in.parts[0].bias.as_ref().unwrap_or(dummy),
                &s.routes,
                dummy,
                dummy,
            ],
            grid(moe.ffn),
        ));
        out.push(self.dispatch(
            &pairs(experts(&lw.mlp_out, moe.ffn, c.d_model, c.d_model, None), true),
            &[
                &s.step,
                &s.expert_act,
                &lw.mlp_out.parts[0].buffer,
                &s.expert_out,
                dummy,
                lw.mlp_out.parts[0].bias.as_ref().unwrap_or(dummy),
                &s.routes,
                dummy,
                dummy,
            ],
            grid(c.d_model),
        ));
        // a shared expert: a dense gated MLP into tmp and its gate's logit, which the experts' sum
        // adds (config validation keeps post-norms, which would also use tmp, away from it)
        if let Some(sh) = &lw.shared {
            let fs = sh.mlp_out.cols;
            out.extend(self.mlp_in(&sh.mlp_in, ProductIo::new(h, c.d_model, &s.act, fs), fs));
            out.extend(self.matmul(&s.act, &sh.mlp_out, &s.tmp, c.d_model, false));
            out.extend(self.product(&sh.gate, ProductIo::new(h, c.d_model, &s.shared_gate, 1)));
        }
        // each token's pairs summed in rank order, as one token's sums alone would be
        let (y, accumulate) = if c.post_norms { (&s.tmp, false) } else { (&s.x, true) };
        let spec_sum = kernels::ExpertProduct {
            product: kernels::Product {
                accumulate,
                bias: false,
                lanes: Lanes::Threads { outs: 1, wg: 64 },
                ..experts(&lw.mlp_out, c.d_model, c.d_model, c.d_model, None)
            },
            slots,
            sum_slots: true,
            x_per_slot: true,
            token_block: EXPERT_TOKEN_BLOCK,
            shared: lw.shared.is_some(),
        };
        let (shared_out, shared_gate) = if lw.shared.is_some() { (&s.tmp, &s.shared_gate) } else { (dummy, dummy) };
        out.push(self.dispatch(
            &spec_sum,
            &[&s.step, &s.expert_out, &lw.mlp_out.parts[0].buffer, y, dummy, dummy, &s.routes, shared_out, shared_gate],
            Grid::ExpertSums { out_rows: c.d_model },
        ));
        if c.post_norms {
            out.push(self.norm(&s.tmp, lw.post_mlp_norm.as_ref(), &s.x, true));
        }
    }
}

impl Engine {
    /// Give forks `dst` the routes of `src` up to the fork point (with `record_routes`).
    pub(super) fn copy_routes(&mut self, src: usize, dst: &[usize]) {
        if let Some(stride) = self.route_stride().filter(|_| self.record_routes) {
            let row_bytes = (self.cache.max_len() * stride * 4) as u64;
            let held = (self.cache.lens()[src] * stride * 4) as u64;
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&self.s.route_log, src as u64 * row_bytes, &self.s.route_log_row, 0, held);
            for &d in dst.iter().filter(|&&d| d != src) {
                enc.copy_buffer_to_buffer(&self.s.route_log_row, 0, &self.s.route_log, d as u64 * row_bytes, held);
            }
            self.gpu.queue.submit([enc.finish()]);
        }
    }

    /// Whether the engine keeps every token's routes ([`EngineOptions::record_routes`](crate::EngineOptions::record_routes)).
    pub fn records_routes(&self) -> bool {
        self.record_routes
    }

    /// Entries per position of [`Engine::routes`]: MoE layers x top_k (`None`: a dense model).
    pub fn route_stride(&self) -> Option<usize> {
        self.cfg.moe.as_ref().map(|m| m.layers.len() * m.top_k)
    }

    /// The experts every position of `row` was routed to, `[len, MoE layers, top_k]` (each
    /// position's experts in the router's order, the MoE layers in layer order), aligned with
    /// the row's token history ([`crate::KvCache::history`]). Needs
    /// [`EngineOptions::record_routes`](crate::EngineOptions::record_routes).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn routes(&self, row: usize) -> Result<Vec<u32>> {
        crate::gpu::pending::block_on(self.routes_async(row))
    }

    /// [`Engine::routes`] that awaits the readback instead of blocking.
    pub async fn routes_async(&self, row: usize) -> Result<Vec<u32>> {
        self.ready()?;
        self.cache.check_rows(&[row])?;
        let Some(stride) = self.route_stride().filter(|_| self.record_routes) else {
            return Err(Error::Input(
                "routes are not recorded: build the engine with EngineOptions::record_routes".into(),
            ));
        };
        let len = self.cache.lens()[row];
        let mut out = vec![0u32; len * stride];
        if len > 0 {
            let row_bytes = (self.cache.max_len() * stride * 4) as u64;
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(
                &self.s.route_log,
                row as u64 * row_bytes,
                &self.s.route_log_read,
                0,
                (out.len() * 4) as u64,
            );
            self.gpu.queue.submit([enc.finish()]);
            self.read_async(&self.s.route_log_read, bytemuck::cast_slice_mut(&mut out)).await?;
        }
        Ok(out)
    }
}
