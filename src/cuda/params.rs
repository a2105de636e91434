//! `FcParams`: the kernel parameter block. Declared once in kernels/params.rs, whose layout
//! build.rs checks against kernels/common/params.h field by field at build time.

include!("../../kernels/params.rs");

// SAFETY: plain-old-data with the C layout the kernels declare (checked by build.rs).
unsafe impl cudarc::driver::DeviceRepr for FcParams {}
