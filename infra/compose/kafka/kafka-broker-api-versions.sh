#!/bin/bash
# Kafka's own tool, as the official distribution's script of this name runs it: the health check's.
exec java -Xmx64m -XX:TieredStopAtLevel=1 -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
  -cp "/opt/kafka/libs/*" org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
