// What this build of the library is: the instruction sets its code paths were compiled for
// (llmserve_kernels/cpu/build.py: -march=native, then $LLMSERVE_KERNEL_FLAGS), which build.isa()
// names. Each picks kernels' code paths at compile time (vec.h, attention.h, quant_fast.h).

extern "C" {

// Bit 0: AVX2 with FMA and F16C; 1: AVX-512 F/BW/VL; 2: AVX512-VNNI; 3: AVX512-BF16.
int llmserve_kernel_isa() {
  int bits = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  bits |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  bits |= 2;
#endif
#if defined(__AVX512VNNI__)
  bits |= 4;
#endif
#if defined(__AVX512BF16__)
  bits |= 8;
#endif
  return bits;
}

}  // extern "C"
