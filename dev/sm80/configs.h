// candidate configs: X(D, BM, BN, WARPS, STAGES)  (final choices of kernels/variants.rs)
#define CFG_D64(X)  X(64, 128, 64, 4, 2)
#define CFG_D128(X) X(128, 128, 32, 4, 2) X(128, 64, 64, 4, 2)
#define CFG_D256(X) X(256, 128, 64, 8, 1)
