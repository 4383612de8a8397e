# libFuzzer harnesses for every decoder of bytes that come from a peer or a user (clang only:
# `make fuzz-short` / `make fuzz` configure build-fuzz with clang; the library is built there with
# -fsanitize=fuzzer-no-link,address,undefined and each harness linked with -fsanitize=fuzzer).
# Each harness's seed corpus is tests/fuzz/corpus/<name>, written by fuzz_seeds.
set(ferry_fuzzers wire_fuzz kv_messages_fuzz moe_section_fuzz user_input_fuzz
                  bootstrap_frames_fuzz)
if(FERRY_HAVE_VERBS)
  list(APPEND ferry_fuzzers verbs_handshake_fuzz)
endif()
foreach(name IN LISTS ferry_fuzzers ITEMS fuzz_seeds)
  add_executable(${name} tests/fuzz/${name}.cc)
  target_link_libraries(${name} PRIVATE ferry_internal PkgConfig::LIBFABRIC)
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  if(FERRY_HAVE_VERBS)
    target_compile_definitions(${name} PRIVATE FERRY_HAVE_VERBS=1)
  endif()
endforeach()
foreach(name IN LISTS ferry_fuzzers)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer)
endforeach()
