//! An unknown `WGPU_BACKEND` is an error naming the value (wgpu alone would find no adapter and
//! say nothing useful). Its own test binary: it sets the variable for the whole process.

use kvdecode::{Error, Gpu};

#[test]
fn unknown_backend_is_named() {
    std::env::set_var("WGPU_BACKEND", "vulkna");
    let e = Gpu::new().expect_err("no device for an unknown backend");
    assert!(matches!(e, Error::Device(_)), "{e}");
    assert!(e.to_string().contains("WGPU_BACKEND=\"vulkna\" names no known backend"), "{e}");
}
