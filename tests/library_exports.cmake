# ctest driver: libferry's dynamic symbol table holds ferry's public API (include/ferry, marked
# FERRY_API) and nothing of its internals. Fails on an exported symbol of an internal namespace
# (ferry::fabric, ferry::moe, ferry::kv, ...: any ferry::lowercase::), and when a few entry points
# users cannot do without are missing.
cmake_minimum_required(VERSION 3.25)
execute_process(COMMAND ${NM} -D -C --defined-only ${LIBRARY}
                OUTPUT_VARIABLE symbols RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "${NM} failed on ${LIBRARY}: ${r}")
endif()
string(REPLACE "\n" ";" lines "${symbols}")
set(internal "")
foreach(line IN LISTS lines)
  # "ADDRESS TYPE NAME": the name may mention ferry:: types in template or function arguments;
  # what counts is the entity itself, at the name's start (after "typeinfo for " and the like).
  string(REGEX REPLACE "^[0-9a-f]+ [A-Za-z] " "" name "${line}")
  string(REGEX REPLACE "^(typeinfo name for |typeinfo for |vtable for |VTT for |guard variable for )"
         "" name "${name}")
  if(name MATCHES "^ferry::[a-z_]+::")
    list(APPEND internal "${name}")
  endif()
endforeach()
list(LENGTH internal n)
if(n GREATER 0)
  list(SUBLIST internal 0 10 first)
  list(JOIN first "\n  " shown)
  message(FATAL_ERROR "libferry exports ${n} internal symbols, e.g.\n  ${shown}")
endif()
foreach(api "ferry::TransferEngine::Create(" "ferry::TransferEngine::~TransferEngine("
            "ferry::TransferEngine::Write(" "ferry::AllToAll::Create(" "ferry::KvPrefill::Create("
            "ferry::KvDecoder::Create(" "ferry::RemoteRegion::Parse(")
  string(FIND "${symbols}" "${api}" at)
  if(at LESS 0)
    message(FATAL_ERROR "libferry does not export ${api}")
  endif()
endforeach()
list(LENGTH lines total)
message(STATUS "libferry: ${total} exported symbols, none internal")
