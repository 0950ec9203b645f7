# cmake -P script behind the `consumer_find_package` and `readme_examples` tests (arguments: see
# register.cmake).
#  1. cmake --install <build> --prefix <fresh dir>/prefix
#  2. configure KDA_CONSUMER_SOURCE_DIR (tests/consumer, tests/readme) with
#     CMAKE_PREFIX_PATH=<prefix> (same generator, compilers, flags, CUDA) and the '|'-separated
#     KDA_CONSUMER_CONFIGURE_ARGS
#  3. build it and run it: its kda_consumer program, or with KDA_CONSUMER_RUN_CTEST its CTest tests.
# Every step's output is printed when it fails; the work directory is kept then for inspection and
# removed after a pass.
cmake_minimum_required(VERSION 3.24)

foreach(required KDA_BINARY_DIR KDA_CONSUMER_SOURCE_DIR KDA_CONSUMER_WORK_DIR KDA_GENERATOR)
  if(NOT DEFINED ${required} OR "${${required}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: ${required} is not set")
  endif()
endforeach()
foreach(var CMAKE_PREFIX_PATH CMAKE_CXX_FLAGS CMAKE_EXE_LINKER_FLAGS CONSUMER_CONFIGURE_ARGS)
  string(REPLACE "|" ";" KDA_${var} "${KDA_${var}}")
endforeach()

# A fresh directory per run, so that nothing from an earlier run is reused; an earlier failed run's
# files (kept for inspection) go now.
file(REMOVE_RECURSE "${KDA_CONSUMER_WORK_DIR}")
string(RANDOM LENGTH 8 ALPHABET "abcdefghijklmnopqrstuvwxyz0123456789" run_id)
set(work_dir "${KDA_CONSUMER_WORK_DIR}/run-${run_id}")
set(prefix "${work_dir}/prefix")
set(consumer_build "${work_dir}/build")
file(REMOVE_RECURSE "${work_dir}")
file(MAKE_DIRECTORY "${work_dir}")

function(run_step what)
  execute_process(COMMAND ${ARGN}
                  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  if(NOT result EQUAL 0)
    string(REPLACE ";" " " command_line "${ARGN}")
    message("---- ${what} failed (${result}): ${command_line}\n${output}----")
    get_filename_component(project_name "${KDA_CONSUMER_SOURCE_DIR}" NAME)
    message(FATAL_ERROR "tests/${project_name}: ${what} failed; files kept in ${work_dir}")
  endif()
  message(STATUS "${what}: ok")
  set(step_output "${output}" PARENT_SCOPE)
endfunction()

set(config_args)
set(ctest_config_args)
if(KDA_CONFIG)
  set(config_args --config "${KDA_CONFIG}")
  set(ctest_config_args -C "${KDA_CONFIG}")
endif()

run_step("install into ${prefix}"
  "${CMAKE_COMMAND}" --install "${KDA_BINARY_DIR}" --prefix "${prefix}" ${config_args})

set(configure_args
  -S "${KDA_CONSUMER_SOURCE_DIR}" -B "${consumer_build}" -G "${KDA_GENERATOR}"
  "-DCMAKE_PREFIX_PATH=${prefix}"
  "-DKDA_EXPECTED_PREFIX=${prefix}"
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
foreach(pair
    "KDA_MAKE_PROGRAM:CMAKE_MAKE_PROGRAM" "KDA_CXX_COMPILER:CMAKE_CXX_COMPILER"
    "KDA_C_COMPILER:CMAKE_C_COMPILER" "KDA_CMAKE_C_FLAGS:CMAKE_C_FLAGS"
    "KDA_BUILD_TYPE:CMAKE_BUILD_TYPE" "KDA_CMAKE_CXX_FLAGS:CMAKE_CXX_FLAGS"
    "KDA_CMAKE_EXE_LINKER_FLAGS:CMAKE_EXE_LINKER_FLAGS" "KDA_CUDA_COMPILER:CMAKE_CUDA_COMPILER"
    "KDA_CUDAToolkit_ROOT:CUDAToolkit_ROOT")
  string(REPLACE ":" ";" pair "${pair}")
  list(GET pair 0 from)
  list(GET pair 1 to)
  if(NOT "${${from}}" STREQUAL "")
    list(APPEND configure_args "-D${to}=${${from}}")
  endif()
endforeach()
list(APPEND configure_args ${KDA_CONSUMER_CONFIGURE_ARGS})
# The build's own prefixes (e.g. where its dependencies live) go through the environment, since a
# ';'-list cannot travel inside one execute_process argument.
if(KDA_CMAKE_PREFIX_PATH)
  string(REPLACE ";" ":" prefix_path_env "${KDA_CMAKE_PREFIX_PATH}")
  if(DEFINED ENV{CMAKE_PREFIX_PATH} AND NOT "$ENV{CMAKE_PREFIX_PATH}" STREQUAL "")
    string(APPEND prefix_path_env ":$ENV{CMAKE_PREFIX_PATH}")
  endif()
  set(ENV{CMAKE_PREFIX_PATH} "${prefix_path_env}")
endif()
run_step("configure the consumer" "${CMAKE_COMMAND}" ${configure_args})
run_step("build the consumer" "${CMAKE_COMMAND}" --build "${consumer_build}" ${config_args})

if(KDA_CONSUMER_RUN_CTEST)
  get_filename_component(cmake_bin_dir "${CMAKE_COMMAND}" DIRECTORY)
  find_program(ctest_command ctest HINTS "${cmake_bin_dir}" NO_DEFAULT_PATH)
  if(NOT ctest_command)
    find_program(ctest_command ctest REQUIRED)
  endif()
  run_step("run the consumer's tests"
    "${ctest_command}" --test-dir "${consumer_build}" --output-on-failure ${ctest_config_args})
else()
  set(consumer_exe "${consumer_build}/kda_consumer")
  if(KDA_CONFIG AND EXISTS "${consumer_build}/${KDA_CONFIG}/kda_consumer")
    set(consumer_exe "${consumer_build}/${KDA_CONFIG}/kda_consumer")  # multi-config generators
  endif()
  run_step("run the consumer" "${consumer_exe}")
endif()
message("${step_output}")

file(REMOVE_RECURSE "${work_dir}")
