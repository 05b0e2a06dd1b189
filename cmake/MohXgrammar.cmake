# xgrammar's C++ core (structured outputs, model/generation/grammar.cc): the
# static library and headers scripts/install_xgrammar.sh builds from the
# pinned sdist (scripts/xgrammar.env, the one place its version lives) into
# MOH_XGRAMMAR_PREFIX (default /opt/moh-serve/xgrammar-<version>). Defines
# the imported target xgrammar::xgrammar. The library is built without
# sanitizers and without LTO, so that every build tree (build/, build-cuda/,
# build-asan/, the TSan build, build-fuzz/) links the same archive.
file(STRINGS "${PROJECT_SOURCE_DIR}/scripts/xgrammar.env" _moh_xg_version
     REGEX "^MOH_XGRAMMAR_VERSION=")
string(REGEX REPLACE "^MOH_XGRAMMAR_VERSION=" "" MOH_XGRAMMAR_VERSION
                     "${_moh_xg_version}")
if(DEFINED ENV{MOH_XGRAMMAR_PREFIX})
  set(_moh_xg_default "$ENV{MOH_XGRAMMAR_PREFIX}")
else()
  set(_moh_xg_default "/opt/moh-serve/xgrammar-${MOH_XGRAMMAR_VERSION}")
endif()
set(MOH_XGRAMMAR_PREFIX "${_moh_xg_default}" CACHE PATH
    "Where scripts/install_xgrammar.sh installed xgrammar")

find_library(MOH_XGRAMMAR_LIBRARY NAMES libxgrammar.a xgrammar
             PATHS "${MOH_XGRAMMAR_PREFIX}/lib" NO_DEFAULT_PATH)
find_path(MOH_XGRAMMAR_INCLUDE_DIR xgrammar/matcher.h
          PATHS "${MOH_XGRAMMAR_PREFIX}/include" NO_DEFAULT_PATH)
if(NOT MOH_XGRAMMAR_LIBRARY OR NOT MOH_XGRAMMAR_INCLUDE_DIR)
  message(FATAL_ERROR
    "xgrammar ${MOH_XGRAMMAR_VERSION} not found in ${MOH_XGRAMMAR_PREFIX}: "
    "run scripts/install_deps.sh (or scripts/install_xgrammar.sh), or set "
    "MOH_XGRAMMAR_PREFIX")
endif()
message(STATUS "xgrammar: ${MOH_XGRAMMAR_LIBRARY}")

add_library(xgrammar::xgrammar STATIC IMPORTED)
set_target_properties(xgrammar::xgrammar PROPERTIES
  IMPORTED_LOCATION "${MOH_XGRAMMAR_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${MOH_XGRAMMAR_INCLUDE_DIR}"
  INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${MOH_XGRAMMAR_INCLUDE_DIR}"
  INTERFACE_COMPILE_DEFINITIONS "XGRAMMAR_ENABLE_CPPTRACE=0"
  INTERFACE_LINK_LIBRARIES Threads::Threads)
