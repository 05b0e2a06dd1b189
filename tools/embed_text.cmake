# cmake -DINPUT=FILE -DOUTPUT=FILE.cc -DSYMBOL=NAME -P embed_text.cmake
# Writes FILE.cc defining `extern const char moh::NAME[]` (the bytes of FILE,
# then a terminating NUL) and `extern const size_t moh::NAME_size` (without
# it), so that a program carries a data file without reading it at run time.
foreach(var INPUT OUTPUT SYMBOL)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "embed_text.cmake: -D${var}= is required")
  endif()
endforeach()
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" hex_length)
math(EXPR size "${hex_length} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
# 16 bytes a line (CMake's regular expressions have no {n}).
string(REPEAT "0x[0-9a-f][0-9a-f]," 16 line)
string(REGEX REPLACE "(${line})" "\\1\n  " bytes "${bytes}")
get_filename_component(name "${INPUT}" NAME)
file(WRITE "${OUTPUT}"
  "// Generated from ${name} by tools/embed_text.cmake; do not edit.\n"
  "#include <cstddef>\n\n"
  "namespace moh {\n\n"
  "extern const char ${SYMBOL}[] = {\n  ${bytes}0x00};\n"
  "extern const size_t ${SYMBOL}_size = ${size};\n\n"
  "}  // namespace moh\n")
