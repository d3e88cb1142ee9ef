# Finds libtorch as the PyPI `torch` wheel ships it (<site-packages>/torch/{include,lib})
# and defines the imported target mixprec_libtorch_cpu (libtorch_cpu and libc10)
# (docs/libtorch.md). Sets MIXPREC_TORCH_FOUND.
#
#   MIXPREC_TORCH       AUTO (default): build mixprec::torch when libtorch is found;
#                       ON: libtorch is required (configure fails without it); OFF: skip.
#   MIXPREC_TORCH_ROOT  the wheel's torch folder (the one holding include/ and lib/), or a
#                       venv (its lib/python3*/site-packages/torch is used). Else the
#                       CMAKE_PREFIX_PATH entries are tried the same way.
#
# Only libtorch_cpu and libc10 are linked, not ${TORCH_LIBRARIES}: the wheel's
# libtorch_cuda.so needs NCCL symbols that a machine without CUDA does not have, and
# TorchConfig.cmake would also look for CUDA. The CUDA code path of mixprec::torch only
# calls ATen operators, which libtorch_cpu dispatches.
set(MIXPREC_TORCH "AUTO" CACHE STRING "Build mixprec::torch (the libtorch adapter): AUTO, ON or OFF")
set_property(CACHE MIXPREC_TORCH PROPERTY STRINGS AUTO ON OFF)
set(MIXPREC_TORCH_ROOT "" CACHE PATH "The torch wheel's folder (include/, lib/) or a venv holding it")
# ON (scripts/device-check.sh, on a machine with an NVIDIA GPU): also link the wheel's
# libtorch_cuda and libc10_cuda, loaded at start (--no-as-needed: they register ATen's CUDA
# kernels from static initialisers), so that the adapter's CUDA path runs in its tests.
option(MIXPREC_TORCH_CUDA "Link libtorch's CUDA libraries into mixprec::torch (a CUDA wheel)" OFF)
set(MIXPREC_TORCH_FOUND OFF)

function(_mixprec_torch_candidates out)
  set(dirs)
  foreach(root ${MIXPREC_TORCH_ROOT} ${CMAKE_PREFIX_PATH})
    list(APPEND dirs ${root})
    file(GLOB sub LIST_DIRECTORIES true ${root}/lib/python3*/site-packages/torch)
    list(APPEND dirs ${sub})
  endforeach()
  set(${out} ${dirs} PARENT_SCOPE)
endfunction()

string(TOUPPER "${MIXPREC_TORCH}" _mixprec_torch_mode)
if(NOT _mixprec_torch_mode STREQUAL "OFF")
  _mixprec_torch_candidates(_cands)
  set(_torch_dir "")
  foreach(d ${_cands})
    if(EXISTS ${d}/include/ATen/ATen.h AND EXISTS ${d}/include/torch/csrc/api/include/torch/torch.h)
      find_library(_mixprec_torch_cpu_lib NAMES torch_cpu PATHS ${d}/lib NO_DEFAULT_PATH)
      find_library(_mixprec_c10_lib NAMES c10 PATHS ${d}/lib NO_DEFAULT_PATH)
      if(_mixprec_torch_cpu_lib AND _mixprec_c10_lib)
        set(_torch_dir ${d})
        break()
      endif()
      unset(_mixprec_torch_cpu_lib CACHE)
      unset(_mixprec_c10_lib CACHE)
    endif()
  endforeach()
  if(_torch_dir)
    set(_ver "")
    foreach(h ${_torch_dir}/include/torch/headeronly/version.h ${_torch_dir}/include/torch/csrc/api/include/torch/version.h)
      if(EXISTS ${h} AND NOT _ver)
        file(STRINGS ${h} _vl REGEX "#define TORCH_VERSION_(MAJOR|MINOR|PATCH) ")
        string(REGEX REPLACE "[^;]*TORCH_VERSION_[A-Z]+ ([0-9]+)" "\\1" _vl "${_vl}")
        string(REPLACE ";" "." _ver "${_vl}")
      endif()
    endforeach()
    # Modern wheels are built with the C++11 ABI of libstdc++ (_GLIBCXX_USE_CXX11_ABI=1);
    # pre-2.7 wheels used the old ABI. Read it from the wheel rather than assume it.
    set(_abi 1)
    execute_process(COMMAND nm -D --defined-only ${_mixprec_c10_lib} OUTPUT_VARIABLE _syms ERROR_QUIET)
    if(_syms AND NOT _syms MATCHES "__cxx11")
      set(_abi 0)
    endif()
    set(_incs ${_torch_dir}/include ${_torch_dir}/include/torch/csrc/api/include)
    # One interface target: include folders (system headers for mixprec's warnings), the
    # ABI, and libtorch_cpu + libc10 by -L/-l with the wheel's lib/ in the run path. (Full
    # paths would make CMake warn that the wheel's own libgomp.so.1 may hide the system's:
    # the process loads one of them, the wheel's, for ATen and oneDNN alike.)
    get_filename_component(_torch_lib_dir ${_mixprec_torch_cpu_lib} DIRECTORY)
    add_library(mixprec_libtorch_cpu INTERFACE IMPORTED GLOBAL)
    set_target_properties(mixprec_libtorch_cpu PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${_incs}"
      INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=${_abi}"
      INTERFACE_LINK_LIBRARIES "-L${_torch_lib_dir};-ltorch_cpu;-lc10;-Wl,-rpath,${_torch_lib_dir}")
    if(MIXPREC_TORCH_CUDA)
      if(NOT EXISTS ${_torch_lib_dir}/libtorch_cuda.so)
        message(FATAL_ERROR "MIXPREC_TORCH_CUDA=ON but ${_torch_lib_dir} has no libtorch_cuda.so (a CPU wheel?)")
      endif()
      set_property(TARGET mixprec_libtorch_cpu APPEND PROPERTY INTERFACE_LINK_LIBRARIES
                   "-Wl,--no-as-needed;-ltorch_cuda;-lc10_cuda;-Wl,--as-needed")
    endif()
    set(MIXPREC_TORCH_FOUND ON)
    set(MIXPREC_TORCH_DIR ${_torch_dir})
    message(STATUS "mixprec::torch: libtorch ${_ver} from ${_torch_dir} (C++11 ABI ${_abi})")
  elseif(_mixprec_torch_mode STREQUAL "ON")
    message(FATAL_ERROR "MIXPREC_TORCH=ON but libtorch was not found: set MIXPREC_TORCH_ROOT to the torch wheel's "
                        "folder (.../site-packages/torch) or to a venv holding it (scripts/deps.sh torch makes "
                        "build/torch-venv)")
  else()
    message(STATUS "mixprec::torch: skipped (libtorch not found; set MIXPREC_TORCH_ROOT, see docs/libtorch.md)")
  endif()
else()
  message(STATUS "mixprec::torch: skipped (MIXPREC_TORCH=OFF)")
endif()
