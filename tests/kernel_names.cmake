# ctest driver: every CUDA kernel of the MoE steps is named in its step's namespace
# (ferry::moe::nv::dispatch / ::combine, node-once's rounding kernel in a ::combine of its own),
# so that a profiler finds a step's kernels by the names "dispatch" and "combine" as it finds
# DeepEP's. Reads the host stubs nvcc makes for each __global__ function (one per kernel and
# template instance, named by its mangled name). The wait costs' sum (AddStridedKernel), which
# either step runs when asked, is the one exception. Fails also when a kernel it knows is missing.
cmake_minimum_required(VERSION 3.25)
execute_process(COMMAND ${NM} --defined-only ${LIBRARY} OUTPUT_VARIABLE symbols RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "${NM} failed on ${LIBRARY}: ${r}")
endif()
string(REPLACE "\n" ";" lines "${symbols}")
set(stubs "")
set(unnamed "")
foreach(line IN LISTS lines)
  if(NOT line MATCHES "__device_stub__(Z[A-Za-z0-9_]+)")
    continue()
  endif()
  set(stub "${CMAKE_MATCH_1}")
  if(stub MATCHES "5ferry3moe")
    list(APPEND stubs "${stub}")
    if(NOT stub MATCHES "8dispatch[0-9]+[A-Za-z]+Kernel|7combine[0-9]+[A-Za-z]+Kernel"
       AND NOT stub MATCHES "16AddStridedKernel")
      list(APPEND unnamed "${stub}")
    endif()
  endif()
endforeach()
list(REMOVE_DUPLICATES unnamed)
if(unnamed)
  list(JOIN unnamed "\n  " shown)
  message(FATAL_ERROR "MoE kernels outside the dispatch and combine namespaces:\n  ${shown}")
endif()
foreach(kernel "8dispatch[0-9]+RouteKernel" "8dispatch[0-9]+PackKernel"
               "8dispatch[0-9]+SendSmallKernel" "8dispatch[0-9]+UnpackKernel"
               "8dispatch[0-9]+QuantizeKernel" "7combine[0-9]+CombineSendKernel"
               "7combine[0-9]+CombineRecvKernel" "7combine[0-9]+CombineRecvStreamedKernel"
               "7combine[0-9]+NarrowKernel")
  set(found FALSE)
  foreach(stub IN LISTS stubs)
    if(stub MATCHES "${kernel}")
      set(found TRUE)
      break()
    endif()
  endforeach()
  if(NOT found)
    message(FATAL_ERROR "no MoE kernel matches ${kernel}")
  endif()
endforeach()
list(REMOVE_DUPLICATES stubs)
list(LENGTH stubs n)
message(STATUS "${n} MoE kernels, each in its step's namespace")
