# Finds LibTorch and adapts the project to the one found: Debian's libtorch-dev
# (1.13, CPU, the default) or the one inside a PyPI torch wheel (2.x, CUDA),
# selected with -DCMAKE_PREFIX_PATH=<torch.utils.cmake_prefix_path> (see
# scripts/build.sh --torch=wheel).
#
# Sets MOH_TORCH_CUDA (ON when the LibTorch has CUDA) and raises
# CMAKE_CXX_STANDARD to what LibTorch's headers need.

# The wheel's Caffe2 config defines protobuf::libprotobuf as an empty alias
# unless the target already exists: Debian's Protobuf must be found first.
find_package(Protobuf REQUIRED)
find_package(Torch REQUIRED)

# TorchConfig looks for its libraries with find_library, which prefers the
# system directories: with Debian's libtorch-dev also installed, a 2.x build
# configured with -DTorch_DIR would link Debian's libtorch.so.1.13.0,
# libtorch_cpu.so.1.13.0 and libc10.so.1.13.0 beside the wheel's (a crash at
# load). Every LibTorch library must come from the LibTorch that was found:
# each path to one (versioned names too) outside TORCH_INSTALL_PREFIX, in
# TORCH_LIBRARIES and in the imported targets' locations and link
# interfaces, is replaced by the found LibTorch's own copy.
function(_moh_own_torch_library path out)
  set(_result "${path}")
  if(path MATCHES "^(.*/)?(lib(c10|torch|shm|caffe2)[^/]*\\.so)(\\.[0-9.]+)?$")
    set(_name ${CMAKE_MATCH_2})
    string(FIND "${path}" "${TORCH_INSTALL_PREFIX}/" _at)
    if(NOT _at EQUAL 0 AND EXISTS ${TORCH_INSTALL_PREFIX}/lib/${_name})
      set(_result ${TORCH_INSTALL_PREFIX}/lib/${_name})
    endif()
  endif()
  set(${out} "${_result}" PARENT_SCOPE)
endfunction()

set(_moh_torch_libraries)
foreach(_lib IN LISTS TORCH_LIBRARIES)
  _moh_own_torch_library("${_lib}" _lib)
  list(APPEND _moh_torch_libraries ${_lib})
endforeach()
# The wheel's libtorch.so exports its own copy of part of std::filesystem
# (2.11: 64 symbols), some of which crash when called from outside it
# (std::filesystem::remove_all jumps to null). libstdc++ is named first, so
# the dynamic linker binds every program's std:: calls to libstdc++ itself.
if(Torch_VERSION VERSION_GREATER_EQUAL 2)
  list(PREPEND _moh_torch_libraries stdc++)
endif()
set(TORCH_LIBRARIES ${_moh_torch_libraries})
foreach(_target torch torch_library torch_cpu torch_cpu_library torch_cuda
                torch_cuda_library c10 c10_cuda caffe2_nvrtc)
  if(NOT TARGET ${_target})
    continue()
  endif()
  get_target_property(_imported ${_target} IMPORTED)
  if(NOT _imported)
    continue()
  endif()
  foreach(_property IMPORTED_LOCATION IMPORTED_LOCATION_RELEASE
                    IMPORTED_LOCATION_RELWITHDEBINFO IMPORTED_LOCATION_NOCONFIG
                    IMPORTED_LOCATION_DEBUG INTERFACE_LINK_LIBRARIES)
    get_target_property(_values ${_target} ${_property})
    if(NOT _values)
      continue()
    endif()
    set(_owned)
    foreach(_value IN LISTS _values)
      _moh_own_torch_library("${_value}" _value)
      list(APPEND _owned "${_value}")
    endforeach()
    set_target_properties(${_target} PROPERTIES ${_property} "${_owned}")
  endforeach()
endforeach()

# LibTorch 2.x declares the C++ standard its headers need (C++20 for the wheels
# of 2.10 and later) on its imported target; the whole project then uses it.
get_target_property(MOH_TORCH_CXX_STANDARD torch CXX_STANDARD)
if(MOH_TORCH_CXX_STANDARD AND MOH_TORCH_CXX_STANDARD GREATER CMAKE_CXX_STANDARD)
  set(CMAKE_CXX_STANDARD ${MOH_TORCH_CXX_STANDARD})
endif()

if(TARGET torch_cuda)
  set(MOH_TORCH_CUDA ON)
else()
  set(MOH_TORCH_CUDA OFF)
endif()

# The wheel carries protobuf headers of another version under include/google:
# moh-serve's generated code must see Debian's, which it links. Point every
# LibTorch target at a copy of the include tree made of links to everything
# but google/ (the wheel itself is left untouched).
set(_moh_torch_include ${TORCH_INSTALL_PREFIX}/include)
if(EXISTS ${_moh_torch_include}/google)
  set(_moh_shadow ${CMAKE_BINARY_DIR}/torch_include)
  file(MAKE_DIRECTORY ${_moh_shadow})
  file(GLOB _moh_entries RELATIVE ${_moh_torch_include} ${_moh_torch_include}/*)
  foreach(_entry IN LISTS _moh_entries)
    if(NOT _entry STREQUAL "google" AND NOT EXISTS ${_moh_shadow}/${_entry})
      file(CREATE_LINK ${_moh_torch_include}/${_entry} ${_moh_shadow}/${_entry}
           SYMBOLIC)
    endif()
  endforeach()
  foreach(_target torch torch_cpu torch_cuda c10 c10_cuda)
    if(TARGET ${_target})
      get_target_property(_dirs ${_target} INTERFACE_INCLUDE_DIRECTORIES)
      if(_dirs)
        string(REPLACE "${_moh_torch_include}" "${_moh_shadow}" _dirs "${_dirs}")
        set_target_properties(${_target} PROPERTIES
          INTERFACE_INCLUDE_DIRECTORIES "${_dirs}")
      endif()
    endif()
  endforeach()
  string(REPLACE "${_moh_torch_include}" "${_moh_shadow}" TORCH_INCLUDE_DIRS
         "${TORCH_INCLUDE_DIRS}")
endif()

# The wheel's libraries find their CUDA libraries (cuBLAS, cuDNN, NCCL, ...)
# in the sibling nvidia/*/lib directories through their own RPATH at run time;
# the linker must look there too, before the CUDA toolkit's older copies.
get_filename_component(_moh_site_packages ${TORCH_INSTALL_PREFIX} DIRECTORY)
file(GLOB _moh_nvidia_libs LIST_DIRECTORIES true ${_moh_site_packages}/nvidia/*/lib)
foreach(_dir IN LISTS _moh_nvidia_libs)
  add_link_options("LINKER:-rpath-link,${_dir}")
endforeach()

message(STATUS "LibTorch ${Torch_VERSION} in ${TORCH_INSTALL_PREFIX} "
               "(CUDA: ${MOH_TORCH_CUDA}), C++${CMAKE_CXX_STANDARD}")
