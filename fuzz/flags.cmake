# MIXPREC_FUZZ: libFuzzer instrumentation for everything this build compiles (the library
# and the fuzz targets), with AddressSanitizer and UndefinedBehaviorSanitizer; the fuzz
# targets link libFuzzer's main (fuzz/CMakeLists.txt). Included from the top CMakeLists.txt
# before any target is created. See docs/fuzzing.md.
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "MIXPREC_FUZZ needs clang (libFuzzer ships with it), found ${CMAKE_CXX_COMPILER_ID}: "
                      "configure with -DCMAKE_CXX_COMPILER=clang++ (make fuzz does)")
endif()
# -O1 -g: fast enough to fuzz, and stack traces that name the line. UBSan findings abort
# (-fno-sanitize-recover), so the fuzzer stops on them and keeps the input.
add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
                    -O1 -g)
add_link_options(-fsanitize=address,undefined)
# clang's -Wdouble-promotion also flags implicit float -> double in assignments and
# arguments, which our code does on purpose (GCC builds keep the warning, under its
# narrower definition); -Wpass-failed only says an `omp simd` loop was not vectorised
# at -O1.
target_compile_options(mixprec_warnings INTERFACE -Wno-double-promotion -Wno-pass-failed)
