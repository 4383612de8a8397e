# ctest driver: install the build into a staging prefix, then configure, build and run a
# consumer project against it with find_package(ferry).
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "install failed: ${r}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "consumer configure failed: ${r}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "consumer build failed: ${r}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "consumer run failed: ${r}")
endif()
# The same program built without CMake: the compiler and linker flags from pkg-config's
# ferry.pc, run against the staged library.
find_program(PKG_CONFIG pkg-config REQUIRED)
file(GLOB pc_file ${WORK_DIR}/prefix/lib*/pkgconfig/ferry.pc
     ${WORK_DIR}/prefix/lib/*/pkgconfig/ferry.pc)
if(NOT pc_file)
  message(FATAL_ERROR "no ferry.pc under ${WORK_DIR}/prefix")
endif()
get_filename_component(pc_dir ${pc_file} DIRECTORY)
set(ENV{PKG_CONFIG_PATH} ${pc_dir})
execute_process(COMMAND ${PKG_CONFIG} --cflags --libs ferry OUTPUT_VARIABLE flags
                OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "pkg-config --cflags --libs ferry failed: ${r}")
endif()
separate_arguments(flags UNIX_COMMAND "${flags}")
execute_process(COMMAND c++ -std=c++20 ${SOURCE_DIR}/main.cc ${flags} -o ${WORK_DIR}/consumer_pc
                RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "consumer build with pkg-config's flags (${flags}) failed: ${r}")
endif()
string(REGEX MATCH "-L[^;]+" libdir_flag "${flags}")
string(SUBSTRING "${libdir_flag}" 2 -1 libdir)
set(ENV{LD_LIBRARY_PATH} ${libdir})
execute_process(COMMAND ${WORK_DIR}/consumer_pc RESULT_VARIABLE r)
if(r)
  message(FATAL_ERROR "consumer (pkg-config build) run failed: ${r}")
endif()
