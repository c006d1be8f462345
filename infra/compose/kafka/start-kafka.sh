#!/bin/bash
# Start a Kafka broker (KRaft) configured from the environment, formatting its storage on first start.
#   KAFKA_<NAME>=value  ->  <name>=value in server.properties: lower case, '_' -> '.', '__' -> '_'
#                           (KAFKA_NODE_ID=1 -> node.id=1; KAFKA_LOG_DIRS -> log.dirs)
#   KAFKA_HEAP_OPTS, KAFKA_OPTS  JVM options, not broker settings
#   CLUSTER_ID          the KRaft cluster id (22 characters of URL-safe base64); formats empty storage
set -euo pipefail

CONFIG=/opt/kafka/config/server.properties
: "${KAFKA_LOG_DIRS:=/var/lib/kafka/data}"
export KAFKA_LOG_DIRS
for required in KAFKA_NODE_ID KAFKA_PROCESS_ROLES KAFKA_LISTENERS KAFKA_CONTROLLER_QUORUM_VOTERS CLUSTER_ID; do
  if [ -z "${!required:-}" ]; then
    echo "start-kafka.sh: $required is not set (see /opt/kafka/bin/start-kafka.sh)" >&2
    exit 2
  fi
done

: > "$CONFIG"
while IFS= read -r name; do
  case "$name" in
    KAFKA_HEAP_OPTS|KAFKA_OPTS) continue ;;
  esac
  key=${name#KAFKA_}
  key=${key,,}
  key=${key//__/@}   # '__' is a literal underscore
  key=${key//_/.}
  key=${key//@/_}
  printf '%s=%s\n' "$key" "${!name}" >> "$CONFIG"
done < <(compgen -e | grep '^KAFKA_' | sort)

cat > /opt/kafka/config/log4j2.properties <<'LOG'
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = STDOUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
LOG

echo "start-kafka.sh: broker settings:"
sed 's/^/  /' "$CONFIG"
CLASSPATH="/opt/kafka/libs/*"
LOG4J="-Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties"
data_dir=${KAFKA_LOG_DIRS%%,*}
if [ ! -f "$data_dir/meta.properties" ]; then
  echo "start-kafka.sh: formatting $data_dir (cluster $CLUSTER_ID)"
  java -Xmx256m "$LOG4J" -cp "$CLASSPATH" kafka.tools.StorageTool format \
    "--cluster-id=$CLUSTER_ID" -c "$CONFIG" --ignore-formatted
fi
# shellcheck disable=SC2086  # the JVM options are words
exec java ${KAFKA_HEAP_OPTS} -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true ${KAFKA_OPTS:-} \
  "$LOG4J" "-Dkafka.logs.dir=/tmp/kafka-logs" -cp "$CLASSPATH" kafka.Kafka "$CONFIG"
