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
