# dsakit_kernel_instances(<table> <kernel header> <instantiate macro> <stem> <list var>)
# Reads the rows `X(<arguments>)` of `#define <table>(X)` in src/cuda/attention/instances.h,
# writes one .cu per row into the build tree (the kernel header, then `<instantiate macro>(<args>)`:
# one explicit instantiation per file) and appends the files to <list var>. Re-runs when the table
# changes; a file is rewritten only when its text changes.
set(DSAKIT_INSTANCES_H ${CMAKE_CURRENT_LIST_DIR}/instances.h)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${DSAKIT_INSTANCES_H})

function(dsakit_kernel_instances table kernel_header instantiate stem out_var)
  # The macro's body: its #define line and every continuation line after it.
  file(READ ${DSAKIT_INSTANCES_H} text)
  string(REGEX MATCH "#define ${table}\\(X\\)([^\n]*\\\\\n)*[^\n]*" body "${text}")
  string(REGEX REPLACE "^#define[^\n]*\n" "" body "${body}")
  string(REGEX MATCHALL "X\\([^)]*\\)" rows "${body}")
  if(NOT rows)
    message(FATAL_ERROR "dsakit: no X(...) rows for ${table} in ${DSAKIT_INSTANCES_H}")
  endif()
  set(sources ${${out_var}})
  foreach(row IN LISTS rows)
    string(REGEX REPLACE "^X\\((.*)\\)$" "\\1" args "${row}")
    string(REPLACE " " "" tag "${args}")
    string(REPLACE "," "_" tag "${tag}")
    set(file ${CMAKE_CURRENT_BINARY_DIR}/instances/${stem}_${tag}.cu)
    file(CONFIGURE OUTPUT ${file} CONTENT
"// Generated from ${table} in src/cuda/attention/instances.h; do not edit.
#include \"${kernel_header}\"

${instantiate}(${args})
")
    list(APPEND sources ${file})
  endforeach()
  set(${out_var} ${sources} PARENT_SCOPE)
endfunction()
