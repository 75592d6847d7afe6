//! kvdecode's own layouts (TinyAgent, the demo model, Engram): no Hugging Face or GGUF form, only
//! kvdecode's names (`names.rs`), the config in the file's own metadata.

use super::{Family, GgufFacts, HfFacts, Spec};

pub(super) const SPEC: Spec = Spec {
    family: Family::Kvdecode,
    hf_types: &[],
    gguf_arch: None,
    table: &[],
    experts: &[],
    hf: HfFacts::PLAIN,
    gguf: GgufFacts::PLAIN,
    from_hf: |_, _| Ok(()),
    from_gguf: |_, _| Ok(()),
};
