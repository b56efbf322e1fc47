# gRPC stubs for ftjax.serve, generated from protos/ftjax/v1/*.proto at build time with grpcio-tools
# and installed as ftjax/serve/_gen/. Included from the top-level CMakeLists.txt (needs Python found).
# Optional: when grpc_tools is not importable the build goes on without the stubs, and
# `ftjax serve` / ftjax.serve.Client then say what is missing.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import grpc_tools.protoc"
  RESULT_VARIABLE FTJAX_GRPC_TOOLS_RC OUTPUT_QUIET ERROR_QUIET)
if(FTJAX_GRPC_TOOLS_RC EQUAL 0)
  file(GLOB FTJAX_PROTOS CONFIGURE_DEPENDS "${CMAKE_CURRENT_LIST_DIR}/ftjax/v1/*.proto")
  set(FTJAX_GEN_DIR "${CMAKE_CURRENT_BINARY_DIR}/serve_gen")
  add_custom_command(
    OUTPUT "${FTJAX_GEN_DIR}/.stamp"
    COMMAND "${CMAKE_COMMAND}" -E rm -rf "${FTJAX_GEN_DIR}"
    COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_LIST_DIR}/generate_stubs.py"
            "${FTJAX_GEN_DIR}" --stamp "${FTJAX_GEN_DIR}/.stamp"
    DEPENDS ${FTJAX_PROTOS} "${CMAKE_CURRENT_LIST_DIR}/generate_stubs.py"
    COMMENT "Generating gRPC stubs from protos/ftjax/v1/*.proto"
    VERBATIM)
  add_custom_target(ftjax_grpc_stubs ALL DEPENDS "${FTJAX_GEN_DIR}/.stamp")
  install(DIRECTORY "${FTJAX_GEN_DIR}/" DESTINATION ftjax/serve/_gen
          FILES_MATCHING PATTERN "*.py" PATTERN "*.pyi")
  message(STATUS "ftjax: gRPC stubs will be generated from protos/ (grpcio-tools found)")
else()
  message(WARNING "grpc_tools (grpcio-tools) is not importable by ${Python_EXECUTABLE}: the gRPC stubs "
                  "(ftjax/serve/_gen) are not generated and `ftjax serve` will not run. Install "
                  "grpcio-tools and reinstall to get them.")
endif()
